"""viz.explore outside headless mode: the live explorer calls the drawing with its controls' values only, so a
drawing with data bound beforehand (functools.partial, as the notebooks pass their measured data) works."""

from __future__ import annotations

from functools import partial

from course_lib import viz


def test_the_live_explorer_draws_with_the_controls_and_the_bound_data(monkeypatch):
    import ipywidgets as widgets

    monkeypatch.delenv("COURSE_HEADLESS", raising=False)
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objects: shown.extend(objects))
    calls = []

    def draw(size, colour, *, measured):
        calls.append((size, colour, measured))

    measured = {"rank 0": [1.0, 2.0]}
    viz.explore(partial(draw, measured=measured), size=(1, 8, 1, 4), colour=["red", "blue"])

    assert calls == [(4, "red", measured)]  # drawn once, at the defaults
    (box,) = shown
    slider, dropdown, _figure = box.children
    assert isinstance(slider, widgets.IntSlider) and isinstance(dropdown, widgets.Dropdown)  # no widget for `measured`
    slider.value = 6
    dropdown.value = "blue"
    assert calls[-2:] == [(6, "red", measured), (6, "blue", measured)]
