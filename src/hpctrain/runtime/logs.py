"""Per-rank logging: every rank writes logs/rank-NNN.log, only rank 0 also prints to the console.

Each line says which rank and host wrote it, so a hang or a crash on one node of many can be
traced to its GPU:

    2026-05-09 07:35:25,123 [rank 3/8 gpu-a2] INFO hpctrain.train: step 100 loss 3.21

Every record is one line: the values logged (file names, manifest fields, a refused pickle
global) may come from files someone else wrote, and a newline in one would forge a line of
the log (:class:`EscapingFormatter`).
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from hpctrain.runtime.env import ProcessEnv
from hpctrain.runtime.redact import redact_text
from hpctrain.runtime.rundir import RunDir
from hpctrain.runtime.safe_open import make_dir, open_append
from hpctrain.shown import shown

LOGGER_NAME = "hpctrain"

# Marks the handlers this module installed, so a second call replaces them instead of adding
# a second copy (which would write every line twice).
_OWNED = "_hpctrain_rank_handler"

# A logged value is cut here: longer than hpctrain.shown.LIMIT, as log lines quote whole paths.
ARG_LIMIT = 1000


def _shown_arg(value: object) -> object:
    # Numbers stay numbers for %d and %.3f; anything else is text the format string quotes.
    if isinstance(value, int | float):
        return value
    return shown(value, ARG_LIMIT)


class EscapingFormatter(logging.Formatter):
    """A Formatter whose records are one line each: the format strings are ours, their
    arguments are not, so each argument is cut and the whole message has its control and
    text-direction characters escaped (which also covers values put in with an f-string) and
    the credentials of any URI in it redacted.
    A traceback (``exc_info``) is added below as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The message with its arguments cut and escaped, then the format applied."""
        args = record.args
        if isinstance(args, dict):
            args = {k: _shown_arg(v) for k, v in args.items()}
        elif args:
            args = tuple(_shown_arg(a) for a in args)
        try:
            message = record.msg % args if args else str(record.msg)
        except (TypeError, ValueError):  # a bad format string: logging's own report follows
            message = record.getMessage()
        record.message = shown(redact_text(message), None)
        return super().formatMessage(record)


def setup_rank_logging(run_dir: RunDir, env: ProcessEnv, *, console: bool) -> logging.Logger:
    """Configure the `hpctrain` logger: file logs/rank-NNN.log, plus stderr at INFO if `console`."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, _OWNED, False)]:
        logger.removeHandler(handler)
        handler.close()

    formatter = EscapingFormatter(
        f"%(asctime)s [rank {env.rank}/{env.world_size} {env.hostname}] "
        "%(levelname)s %(name)s: %(message)s"
    )
    log_path = run_dir.rank_log(env.rank)
    make_dir(log_path.parent)
    # Append: a requeued or resumed job keeps the log of its earlier attempts above the new one.
    file_handler = _RunFileHandler(log_path)
    file_handler.setLevel(logging.DEBUG)
    handlers: list[logging.Handler] = [file_handler]
    if console:
        stream_handler = logging.StreamHandler(sys.stderr)
        stream_handler.setLevel(logging.INFO)
        handlers.append(stream_handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _OWNED, True)
        logger.addHandler(handler)

    logger.setLevel(logging.DEBUG)
    # Not propagating keeps a root handler (pytest, a notebook, basicConfig) from printing every
    # rank's lines to the console a second time.
    logger.propagate = False
    return logger


def log_device_binding(logger: logging.Logger, env: ProcessEnv, device: torch.device) -> None:
    """Log in one line which host, rank and local rank drive which device."""
    logger.info(
        "device binding: host %s rank %d/%d local rank %d/%d device %s CUDA_VISIBLE_DEVICES=%s",
        env.hostname,
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        device,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
    )


class _RunFileHandler(logging.FileHandler):
    """A FileHandler that appends to its file in a run directory without following links."""

    def __init__(self, path: os.PathLike[str]) -> None:
        # Opened now (delay=False) so that a planted link fails the start, not a later line.
        super().__init__(path, mode="a", encoding="utf-8")

    def _open(self):  # noqa: ANN202 - logging.FileHandler's own hook
        return open_append(self.baseFilename)
