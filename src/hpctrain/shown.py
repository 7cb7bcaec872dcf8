"""Text from files and command lines, made safe to show in a log, a terminal or an error.

A run directory, a checkpoint or a data folder may have been written by someone else: a file
name, a manifest value or a refused pickle global's name can hold a newline (a forged log line),
an ANSI escape (a rewritten terminal), a bidi override (text that reads other than it is) or a
megabyte of text. :func:`shown` makes such a value visible as what it is, on one line, bounded:

    >>> shown("a\\nb\\x1b[2J")
    'a\\\\nb\\\\x1b[2J'
"""

from __future__ import annotations

import re

# How many characters of one value are shown; the rest is cut, saying how long it was.
LIMIT = 200

# C0 and C1 controls, DEL, and the Unicode characters that move or reorder text: line and
# paragraph separators (a line break to many terminals and editors), bidi embeddings, overrides
# and isolates (Trojan Source), the zero-width and BOM characters that hide text in names.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match[0]
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(value: object, limit: int | None = LIMIT) -> str:
    """``str(value)`` with control and text-direction characters escaped, cut to ``limit``."""
    text = value if isinstance(value, str) else str(value)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return _UNSAFE.sub(_escape, text)


def quoted(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit``: for a value read back from a file, whose quotes show
    where it ends (repr escapes control, separator and text-direction characters itself)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
