"""Errors a user can cause, each carrying what was wrong, what was expected and a hint.

The CLI turns any `HpctrainError` into a one-paragraph message and a non-zero exit code instead
of a traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HpctrainError(Exception):
    """Base class for errors caused by user input or the environment, not by a bug."""

    exit_code = 2

    def __init__(self, what: str, *, expected: str | None = None, hint: str | None = None):
        self.what = what
        self.expected = expected
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        """Return the message as the user sees it: what, expected, hint on separate lines."""
        lines = [self.what]
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
