"""Reading ``exit_info.json`` back (``RunDir.write_exit_info`` writes it): checked, never trusted.

Readers (resume, goodput, ``runs``, ``report``, ``pipeline status``) get the record only when it
fits the schema below; a damaged one is ``BadRecord`` naming the field, which each reader
reports and goes on without.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpctrain.records import BadRecord, Int, Real, Record, Str
from hpctrain.runtime.safe_open import UnsafeRunPath, read_bytes

EXIT_INFO = Record({
    "exit_code": Int(-(2**31), 2**31 - 1),
    "reason": Str(1 << 16, optional=True),
    "last_checkpoint": Str(255, optional=True, nullable=True),
    "timestamp": Real(0.0),
    "time_utc": Str(64, optional=True),
    "hostname": Str(255, optional=True),
    "pid": Int(0, 2**31 - 1, optional=True),
    "extra": Record({"steps": Int(optional=True, nullable=True)}, optional=True),
})


def read_exit_info(path: Path) -> dict[str, Any] | None:
    """The checked record at ``path``; None when there is none; BadRecord when it is damaged."""
    try:
        text = read_bytes(path)  # never through a link planted in a shared run directory
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadRecord(f"{path} is unreadable: {e.strerror or e}") from None
    except UnsafeRunPath as e:
        raise BadRecord(e.what) from None
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRecord(f"{path} is not JSON ({str(e)[:80]})") from None
    return EXIT_INFO.check(data, path)


def exit_info_or_none(path: Path) -> dict[str, Any] | None:
    """The checked record at ``path``, or None when it is missing or damaged."""
    try:
        return read_exit_info(path)
    except BadRecord:
        return None
