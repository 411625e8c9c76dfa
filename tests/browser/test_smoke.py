"""Real-browser smoke test: JupyterLab in headless Chromium runs two notebooks end to end.

For each notebook: open it, run all cells, wait for the kernel to go idle, then check that no
cell raised or printed a traceback, that every `%%torchrun` and `%%px` cell shows its ranks' output, that
the explorer (course_lib.viz.explore) renders live sliders, and that moving a slider with the
keyboard redraws its figure. Screenshots go to build/browser/: NAME-torchrun.png (the first
%%torchrun cell's output), NAME-before.png and NAME-after.png (the explorer around the slider move).

Run with `make test-browser` (not part of `make test`).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from conftest import REPO

NOTEBOOKS = ["00_torchrun_and_process_groups.ipynb", "01_collectives.ipynb"]
OPEN_TIMEOUT_MS = 120_000  # page load and kernel start
RUN_TIMEOUT_MS = 420_000  # run all cells (each %%torchrun cell starts fresh rank processes)
REDRAW_TIMEOUT_S = 60

STDERR = "application/vnd.jupyter.stderr"

# The notebook panel showing `path`, found among the main area's widgets.
FIND_PANEL = """
(path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.sessionContext) return w;
  }
  return null;
}
"""

OPENED = f"""
(path) => {{
  const panel = ({FIND_PANEL})(path);
  return !!(panel && panel.context.isReady && panel.content.widgets.length > 0
            && panel.sessionContext.session && panel.sessionContext.session.kernel
            && panel.sessionContext.session.kernel.status === 'idle');
}}
"""

RUN_ALL = f"""
(path) => {{
  const app = window.jupyterapp;
  const panel = ({FIND_PANEL})(path);
  app.shell.activateById(panel.id);
  window.__runAll = undefined;
  app.commands.execute('notebook:run-all-cells').then(
    ok => {{ window.__runAll = {{ok: ok === undefined ? null : ok}}; }},
    err => {{ window.__runAll = {{error: String(err)}}; }});
}}
"""

IDLE = f"""
(path) => {{
  const panel = ({FIND_PANEL})(path);
  return window.__runAll !== undefined && panel.sessionContext.session.kernel.status === 'idle';
}}
"""

# Code cells as the front end holds them; each cell's node gets data-smoke-cell=INDEX for locators.
CELLS = f"""
(path) => {{
  const panel = ({FIND_PANEL})(path);
  const cells = [];
  panel.content.widgets.forEach((cell, index) => {{
    cell.node.setAttribute('data-smoke-cell', String(index));
    if (cell.model.type !== 'code') return;
    cells.push({{
      index,
      source: cell.model.sharedModel.getSource(),
      executionCount: cell.model.executionCount,
      outputs: cell.model.outputs.toJSON(),
    }});
  }});
  return cells;
}}
"""


def _text(output: dict) -> str:
    if output.get("output_type") == "stream":
        text = output.get("text", "")
    else:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text) if isinstance(text, list) else text


def _stored_rank_lines(path) -> list[list[str]]:
    """For each code cell of the stored notebook: the rank prefixes its stored output shows.

    `[rank R]`, in a %%torchrun cell and in a %%px cell of the persistent session alike.
    """
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    prefix = re.compile(r"^\[rank \d+\]", re.M)
    return [sorted(set(prefix.findall("".join(map(_text, c.get("outputs", [])))))) for c in cells]


def _describe(cell: dict) -> str:
    return (
        f"cell {cell['index']} ({cell['source'].splitlines()[0][:60]!r})" if cell["source"] else f"cell {cell['index']}"
    )


@pytest.fixture
def page(browser, lab):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    console_errors: list[str] = []
    page.on("pageerror", lambda err: console_errors.append(str(err)))
    page.console_errors = console_errors
    try:
        yield page
    finally:
        try:
            context.close()
        finally:
            lab.shutdown_kernels()  # free the cores (and the rank processes) before the next notebook


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(lab, page, artifacts, name: str):
    stem = name.removesuffix(".ipynb")
    stored_rank_lines = _stored_rank_lines(REPO / "notebooks" / name)  # the lab runs the learner's copy: no output
    try:
        _run_and_check(lab, page, name, artifacts / stem, stored_rank_lines)
    except BaseException:
        page.screenshot(path=f"{artifacts / stem}-failure.png", full_page=True)
        raise


def _run_and_check(lab, page, name: str, shots, stored_rank_lines: list[list[str]]) -> None:
    opening = time.monotonic()
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
    page.wait_for_function(OPENED, arg=name, timeout=OPEN_TIMEOUT_MS, polling=500)

    started = time.monotonic()
    page.evaluate(RUN_ALL, name)
    page.wait_for_function(IDLE, arg=name, timeout=RUN_TIMEOUT_MS, polling=1000)
    run_all = page.evaluate("() => window.__runAll")
    ran_for = time.monotonic() - started

    cells = page.evaluate(CELLS, name)
    code_cells = [c for c in cells if c["source"].strip()]
    assert len(cells) == len(stored_rank_lines), "the page's code cells differ from the stored notebook's"

    # 1. Every code cell ran, none raised, no traceback on stderr (model and DOM both).
    errors = [
        f"{_describe(c)}: {o.get('ename')}: {o.get('evalue')}"
        for c in cells
        for o in c["outputs"]
        if o.get("output_type") == "error"
    ]
    tracebacks = [
        f"{_describe(c)}:\n{_text(o)[-1500:]}"
        for c in cells
        for o in c["outputs"]
        if o.get("output_type") == "stream" and o.get("name") == "stderr" and "Traceback" in _text(o)
    ]
    assert not errors, "cells raised:\n" + "\n".join(errors)
    assert not tracebacks, "tracebacks on stderr:\n" + "\n".join(tracebacks)
    assert run_all == {"ok": True}, f"notebook:run-all-cells ended with {run_all}"
    not_run = [_describe(c) for c in code_cells if c["executionCount"] is None]
    assert not not_run, f"cells not executed: {not_run}"

    for cell in cells:
        page.locator(f'[data-smoke-cell="{cell["index"]}"]').scroll_into_view_if_needed()
    dom_tracebacks = page.locator(f'.jp-OutputArea-output[data-mime-type="{STDERR}"]', has_text="Traceback")
    assert dom_tracebacks.count() == 0, dom_tracebacks.all_inner_texts()

    # 2. Every %%torchrun and %%px cell shows its ranks' output (the ranks the stored notebook shows).
    torchrun_cells = [(i, c) for i, c in enumerate(cells) if c["source"].startswith("%%torchrun")]
    px_cells = [(i, c) for i, c in enumerate(cells) if c["source"].startswith("%%px")]
    assert torchrun_cells, "expected %%torchrun cells"
    assert px_cells, "expected %%px cells (the persistent session)"
    for i, cell in torchrun_cells + px_cells:
        expected = stored_rank_lines[i]
        if not expected:  # the stored output has no rank lines (e.g. a cell that prints nothing)
            continue
        area = page.locator(f'[data-smoke-cell="{cell["index"]}"] .jp-OutputArea')
        area.scroll_into_view_if_needed()
        shown = area.inner_text()
        missing = [prefix for prefix in expected if prefix not in shown]
        assert not missing, f"{_describe(cell)} does not show {missing}; it shows:\n{shown[:1500]}"

    first = page.locator(f'[data-smoke-cell="{torchrun_cells[0][1]["index"]}"]')
    first.evaluate("node => node.scrollIntoView({block: 'start'})")
    page.screenshot(path=f"{shots}-torchrun.png", full_page=True)

    # 3. The explorer renders live sliders and an image.
    explorers = [c for c in cells if "explore(" in c["source"]]
    assert explorers, "expected an explorer cell (viz.explore)"
    explorer = page.locator(f'[data-smoke-cell="{explorers[-1]["index"]}"]')
    explorer.scroll_into_view_if_needed()
    sliders = explorer.locator(".jupyter-widgets .widget-slider")
    sliders.first.wait_for(state="visible", timeout=60_000)
    image = explorer.locator(".jp-OutputArea-output img").first
    image.wait_for(state="visible", timeout=60_000)
    explorer.scroll_into_view_if_needed()
    page.screenshot(path=f"{shots}-before.png", full_page=True)

    # 4. Moving the first slider with the keyboard redraws the figure.
    handle = sliders.first.locator(".noUi-handle").first
    before_src = image.get_attribute("src")
    before_value = handle.get_attribute("aria-valuenow")
    at_max = float(before_value) >= float(handle.get_attribute("aria-valuemax"))
    handle.focus()
    page.keyboard.press("ArrowLeft" if at_max else "ArrowRight")
    deadline = time.monotonic() + REDRAW_TIMEOUT_S
    after_src = before_src
    while time.monotonic() < deadline:
        current = explorer.locator(".jp-OutputArea-output img")
        if current.count():
            after_src = current.first.get_attribute("src")
            if after_src and after_src != before_src:
                break
        time.sleep(0.25)
    after_value = handle.get_attribute("aria-valuenow")
    assert after_value != before_value, f"the slider did not move (value {before_value})"
    assert after_src != before_src, f"the figure was not redrawn after the slider moved {before_value} -> {after_value}"
    explorer.scroll_into_view_if_needed()
    page.screenshot(path=f"{shots}-after.png", full_page=True)

    assert not page.console_errors, f"uncaught errors in the page: {page.console_errors}"
    print(
        f"{name}: opened in {started - opening:.0f} s, ran all cells in {ran_for:.0f} s, checked in "
        f"{time.monotonic() - started - ran_for:.0f} s; slider {before_value} -> {after_value} redrew the figure"
    )
