"""Ctrl-C: exit code 130 and one line saying how to continue."""

from __future__ import annotations

from pathlib import Path

from hpctrain.errors import HpctrainError

# 128 + SIGINT: what a shell reports for a program stopped by Ctrl-C.
INTERRUPTED = 130


class Interrupted(HpctrainError):
    """The run was stopped by SIGINT; it resumes from its last committed checkpoint."""

    exit_code = INTERRUPTED

    def __init__(self, run_root: Path, latest: str | None):
        if latest:
            hint = f"rerun the same command to resume from {latest} in {run_root}"
        else:
            hint = (f"no checkpoint was committed yet: rerunning the same command starts "
                    f"{run_root} again at step 0")
        super().__init__("interrupted (Ctrl-C)", hint=hint)

    def line(self) -> str:
        """The one line the user sees."""
        return f"hpctrain: {self.what}; {self.hint}"
