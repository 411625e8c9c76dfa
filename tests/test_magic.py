"""The %%torchrun flags are defined once: the help `%%torchrun?` shows and the README's list agree with them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from course_lib.launch import RunSpec
from course_lib.launch.magic import TorchrunMagics, parse_flags

ROOT = Path(__file__).resolve().parent.parent


def magic_flags() -> set[str]:
    """Every option string the magic's parser accepts (aliases included)."""
    parser = TorchrunMagics.torchrun.parser  # built by IPython's @magic_arguments
    return {flag for action in parser._actions for flag in action.option_strings}


def readme_flags() -> set[str]:
    """The flags in README.md's paragraph that lists them (from "Flags:" to "Notebook variables")."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^Flags:(.*?)^Notebook variables", text, re.S | re.M)
    assert section, "README.md lists the %%torchrun flags in a paragraph starting 'Flags:'"
    spans = re.findall(r"`([^`]*)`", section.group(1))
    return {flag for span in spans for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", span)}


def test_readme_lists_every_flag_and_only_those():
    defined, listed = magic_flags(), readme_flags()
    assert defined - listed == set(), "flags the README does not list"
    assert listed - defined == set(), "flags the README lists but the magic does not define"


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_lib")
    return ip


def test_help_shows_every_flag_with_its_help(shell):
    shown = shell.object_inspect_text("%%torchrun")  # what `%%torchrun?` prints
    assert "%%torchrun [-n N]" in shown
    for action in TorchrunMagics.torchrun.parser._actions:
        for flag in action.option_strings:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", shown), flag
        assert " ".join(action.help.split()[:4]) in " ".join(shown.split()), action.help


def test_flags_left_out_take_the_spec_defaults():
    assert parse_flags("") == {}
    assert RunSpec.create(**parse_flags("")) == RunSpec.create()


def test_flags_arrive_as_text_and_the_spec_converts_them():
    flags = parse_flags("--nproc 3 --backend gloo --timeout 9.5 --out a,b --no-init --stream --save job.py")
    assert flags.pop("save") == "job.py"
    assert RunSpec.create(**flags) == RunSpec(
        nproc=3, backend="gloo", timeout=9.5, out=("a", "b"), stream=True, init=False
    )
    assert parse_flags("--nproc-per-node 4") == parse_flags("-n 4") == {"nproc": "4"}


@pytest.mark.parametrize("line", ["--time 5", "4", '-n "2', "--stream yes"])
def test_a_line_argparse_refuses_is_a_launch_error_of_one_line(line):
    from course_lib.launch import LaunchError

    with pytest.raises(LaunchError) as info:
        parse_flags(line)
    assert "\n" not in str(info.value) and "%%torchrun?" in str(info.value)
