"""What several test files build notebooks and probe kernels with."""

from __future__ import annotations

from pathlib import Path

import nbformat


def write_notebook(path: Path, *sources: str) -> Path:
    """A notebook of code cells at `path`; the first is tagged `parameters`."""
    cells = [nbformat.v4.new_code_cell(source) for source in sources]
    cells[0].metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def fake_gpus_code(gpus: int) -> str:
    """Code that makes torch report `gpus` CUDA devices in the process that runs it (a kernel: no rank sees it)."""
    return f"import torch\ntorch.cuda.is_available = lambda: {gpus > 0}\ntorch.cuda.device_count = lambda: {gpus}\n"
