"""Errors a user can cause, each carrying what was wrong, what was expected and a hint.

The CLI turns any `HpctrainError` into a one-paragraph message and a non-zero exit code instead
of a traceback; everything else is a bug and keeps its traceback.

Messages quote file names, config values and the content of files someone else may have
written, so every part is passed through :func:`hpctrain.shown.shown` here, once for all error
sites: a newline or an ANSI escape in a quoted value is shown as ``\\n`` / ``\\x1b``, never
emitted, a huge value is cut, and the password of a URI is redacted.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpctrain.runtime.redact import redact_text
from hpctrain.shown import shown

# Each part of a message is bounded; the values quoted in it should be cut much earlier (at
# hpctrain.shown.LIMIT), this only stops a message from carrying a whole file.
PART_LIMIT = 4000


def _safe(part: str | None) -> str | None:
    return None if part is None else shown(redact_text(part), PART_LIMIT)


class HpctrainError(Exception):
    """Base class for errors caused by user input or the environment, not by a bug."""

    exit_code = 2

    def __init__(self, what: str, *, expected: str | None = None, hint: str | None = None,
                 lines: Iterable[str] = ()):
        """``lines``: further lines shown under ``what`` (a log tail), each escaped on its own."""
        self.what = _safe(what)
        self.expected = _safe(expected)
        self.hint = _safe(hint)
        self.lines = tuple(_safe(line) for line in lines)
        super().__init__(self.render())

    def render(self) -> str:
        """Return the message as the user sees it: what, expected, hint on separate lines."""
        lines = [self.what, *self.lines]
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.hint:
            lines.append(f"  HINT: {self.hint}")
        return "\n".join(lines)


class ConfigError(HpctrainError):
    """A configuration key or value is invalid."""


class RuntimeEnvError(HpctrainError):
    """The process environment (launcher variables, devices) is inconsistent."""


class LaunchError(HpctrainError):
    """Starting or supervising worker processes failed."""

    exit_code = 1


class DataError(HpctrainError):
    """Token data on disk or its inputs are missing, unreadable, corrupted or inconsistent."""
