"""Where ``-o FILE`` of a generating command (``sbatch``, ``k8s``) puts its text.

The folder is created when missing (as a user writing ``-o runs/k8s/job.yaml`` expects), the
file appears whole or not at all, and a path that cannot be written is refused with what to do
instead of a traceback.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hpctrain.errors import ConfigError
from hpctrain.runtime.safe_open import current_umask


def write_output(path: Path, text: str, *, flag: str = "-o") -> Path:
    """Write ``text`` to ``path``, creating its folder; ConfigError if it cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory",
                          expected="a file name, e.g. " + str(path / "job.out"),
                          hint="name the file to write inside it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temporary file beside it, renamed into place: a reader never sees half a script.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o666 & ~current_umask())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise ConfigError(f"{flag} {str(path)!r} cannot be written: {e.strerror or e}",
                          expected="a path in a folder you can create and write",
                          hint="choose another path, or leave out "
                          f"{flag} to print to stdout") from None
    return path

