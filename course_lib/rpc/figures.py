"""Kernel side (figures only): the parameter servers' loss curves against the data-parallel reference."""

from __future__ import annotations

from typing import Any


def draw_loss_curves(
    n_trainers: int, mode: str, *, runs: dict[tuple[str, int], dict[str, Any]], references: dict[int, list[float]]
) -> None:
    """The loss of each trainer step of the sync and/or async server (`mode`: "sync", "async" or "both") with
    `n_trainers`, over the data-parallel reference (which the sync server equals)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for m in ("sync", "async") if mode == "both" else (mode,):
        ax.plot(runs[m, n_trainers]["losses"], linestyle="-" if m == "sync" else "--", label=m)
    ax.plot(references[n_trainers], ":", color="black", label="data-parallel reference (= sync)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("loss")
    ax.set_ylim(0, 0.5)
    ax.set_title(f"{n_trainers} trainer(s)")
    ax.legend(fontsize=8)
    plt.show()
