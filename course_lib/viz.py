"""What notebooks display: library source, figures, and parameter explorers."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any


def show(obj: Any) -> None:
    """Display the source of a course_lib function, class or module, syntax-highlighted."""
    from IPython.display import Code, display

    display(Code(inspect.getsource(obj), language="python"))


def label_box(ax: Any, x: float, y: float, text: str, color: str = "lightblue", **options: Any) -> None:
    """`text` in a rounded box centred on (x, y): a rank or a store in the course's diagrams."""
    options.setdefault("fontsize", 8)
    ax.text(x, y, text, ha="center", va="center", bbox=dict(boxstyle="round", facecolor=color), **options)


def headless() -> bool:
    return os.environ.get("COURSE_HEADLESS") == "1"


def explore(draw: Callable[..., None], **controls: Any) -> None:
    """`draw(**values)` under sliders/dropdowns, redrawn when one moves."""
    defaults = {name: _default(spec) for name, spec in controls.items()}
    if headless():
        draw(**defaults)
        return
    import ipywidgets as widgets
    from IPython.display import display

    made = {name: _widget(name, spec) for name, spec in controls.items()}
    # interactive_output, not interact: interact would also make a widget for every bound argument of `draw`
    # (from its default or its annotation) and needs `draw.__name__`, which a partial has not.
    figure = widgets.interactive_output(draw, made)
    display(widgets.VBox([*(w for w in made.values() if isinstance(w, widgets.Widget)), figure]))


def _default(spec: Any) -> Any:
    if isinstance(spec, tuple) and len(spec) == 4:
        return spec[3]
    if isinstance(spec, list):
        return spec[0]
    return spec


def _widget(name: str, spec: Any):
    import ipywidgets as widgets

    if isinstance(spec, tuple) and len(spec) == 4:
        lo, hi, step, value = spec
        cls = widgets.IntSlider if all(isinstance(v, int) for v in spec) else widgets.FloatSlider
        return cls(min=lo, max=hi, step=step, value=value, description=name, continuous_update=False)
    if isinstance(spec, list):
        return widgets.Dropdown(options=spec, value=spec[0], description=name)
    return widgets.fixed(spec)
