"""Expand Slurm hostlist expressions such as ``node[001-003,007],gpu-a[1-2]`` into host names.

    >>> expand_hostlist("node[001-003,007],gpu-a[1-2]")
    ['node001', 'node002', 'node003', 'node007', 'gpu-a1', 'gpu-a2']

Pure Python so it works where ``scontrol show hostnames`` does not (login nodes without Slurm
binaries in PATH, tests, containers).
"""

from __future__ import annotations

import itertools
import re

from hpctrain.errors import RuntimeEnvError

# One element inside brackets: "7", "001-003".
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(spec: str) -> list[str]:
    """Return the host names a Slurm hostlist expression stands for, in Slurm's order."""
    if not spec.strip():
        raise _error(spec, "the hostlist is empty")
    hosts: list[str] = []
    for pattern in _split_top_level(spec):
        hosts.extend(_expand_one(spec, pattern))
    return hosts


def _split_top_level(spec: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _error(spec, f"nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _error(spec, f"unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise _error(spec, "unbalanced '[' (missing ']')")
    parts.append(spec[start:])
    for part in parts:
        if not part.strip():
            raise _error(spec, "empty host name between commas")
    return [part.strip() for part in parts]


def _expand_one(spec: str, pattern: str) -> list[str]:
    """Expand one host pattern that may hold several bracket groups (cartesian product)."""
    # re.split with a capture group alternates literal text and bracket contents:
    # "rack[1-2]-n[01-02]" -> ["rack", "1-2", "-n", "01-02", ""].
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        choices.append(_expand_brackets(spec, piece) if i % 2 else [piece])
    # The leftmost group varies slowest, as in `scontrol show hostnames`.
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_brackets(spec: str, body: str) -> list[str]:
    """Expand the inside of one bracket group: ``001-003,007`` -> 001, 002, 003, 007."""
    values: list[str] = []
    for element in body.split(","):
        match = _RANGE.match(element.strip())
        if match is None:
            raise _error(spec, f"bad range '{element}' inside '[{body}]'")
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            values.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if high < low:
            raise _error(spec, f"reversed range '{element}' (end below start)")
        # Slurm pads to the width of the start bound: node[08-10] -> node08, node09, node10.
        width = len(low_text)
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    return values


def _error(spec: str, problem: str) -> RuntimeEnvError:
    return RuntimeEnvError(
        f"cannot expand Slurm hostlist {spec!r}: {problem}",
        expected="comma-separated names with optional ranges, e.g. 'node[001-004,007],gpu1'",
        hint="check SLURM_JOB_NODELIST; `scontrol show hostnames <list>` shows Slurm's reading",
    )
