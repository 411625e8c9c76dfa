"""What the debug variables print, filtered out of the ranks' output and made comparable between runs.

``TORCH_CPP_LOG_LEVEL=INFO`` lets c10d's C++ log through (glog lines: ``[I1201 07:40:52.846 debug.cpp:48] ...``);
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds a fingerprint line per collective and the mismatch error;
``NCCL_DEBUG=INFO`` makes NCCL print ``host:pid:tid [device] NCCL INFO ...`` lines. Timestamps, ports,
pointers and pids change from run to run: :func:`sanitize` replaces them, so what is printed can be stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAUNCHER_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")  # how launch(stream=True) hands over a rank's line
_GLOG = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} [\d:.]+ (?:\d+ )?([\w.]+):\d+\] (.*)$")
_NCCL = re.compile(r"^\S+:\d+:\d+ \[\d+\] (NCCL (?:INFO|WARN) .*)$")
_VARYING = [
    (re.compile(r", TensorDeviceTypes=TensorOptions\(.*?\)\)"), ", ..."),  # the same on every rank: noise
    (re.compile(r" on SocketImpl\(.*\)\.?$"), ""),
    (re.compile(r"(\]|localhost|127\.0\.0\.1|\)):\d{2,5}\b"), r"\1:PORT"),
    (re.compile(r"\(localhost, \d+\)"), "(localhost, PORT)"),
    (re.compile(r"0x[0-9a-f]+"), "0x..."),
]


def rank_lines(chunks: Iterable[str]) -> dict[int, list[str]]:
    """Each rank's lines, from the text that ``launch(..., stream=True, write=...)`` passed to `write`."""
    lines: dict[int, list[str]] = {}
    for chunk in chunks:
        for line in chunk.splitlines():
            if m := _LAUNCHER_LINE.match(line):
                lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


def sanitize(text: str) -> str:
    """The same text with what varies between runs (ports, pointers, socket details) replaced."""
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return text


def c10d_log(lines: Iterable[str]) -> list[tuple[str, str]]:
    """(source file, message) of each C++ log line among `lines`: what TORCH_CPP_LOG_LEVEL lets through."""
    return [(m.group(1), sanitize(m.group(2))) for line in lines if (m := _GLOG.match(line))]


def nccl_log(lines: Iterable[str]) -> list[str]:
    """NCCL's own lines (NCCL_DEBUG=INFO), without the host:pid:thread prefix, pointers replaced."""
    return [sanitize(m.group(1)) for line in lines if (m := _NCCL.match(line))]
