"""Shared test set-up: headless notebooks, and nbval compares stdout/results but not stderr."""

import os

import pytest

os.environ["COURSE_HEADLESS"] = "1"  # explorers draw their default view (course_lib.viz)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collectstart(collector):
    # Rank stderr (library log lines) is allowed to differ between machines; stdout and
    # results are compared. tests/test_notebooks.py checks no output carries a warning.
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)


@pytest.fixture
def probe_kernel(tmp_path):
    """A kernel in notebooks/ that runs a notebook's first cells alone (tools.probe)."""
    from tools import probe, runner

    kernel = probe.Kernel(runner.NOTEBOOKS, probe.kernel_env(tmp_path), tmp_path / "kernel-ipc")
    yield kernel
    kernel.close()
