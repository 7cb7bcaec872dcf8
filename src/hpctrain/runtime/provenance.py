"""Record what produced a run: code version, software versions, hardware, hosts, command line.

Environment variables are never copied wholesale: they hold tokens and passwords (HF_TOKEN,
WANDB_API_KEY, ...). Only an allow-list is recorded, and secret-looking names are dropped even
from it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import torch

from hpctrain.runtime.redact import SECRET_WORDS, redact_argv, redact_text
from hpctrain.runtime.rundir import RunDir, write_json_atomic
from hpctrain.runtime.safe_open import make_dir, write_atomic

_ENV_ALLOW = (
    "CUDA_VISIBLE_DEVICES",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NTASKS",
    "OMP_NUM_THREADS",
)
_ENV_ALLOW_PREFIX = "NCCL_"
_GIT_TIMEOUT_S = 10


def collect_provenance(hosts: list[str]) -> dict[str, Any]:
    """Return a JSON-ready dict describing the code, software, hardware and hosts of this run."""
    cuda_available = torch.cuda.is_available()
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": _git_dirty(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda_available else None,
        "nccl": _nccl_version() if cuda_available else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda_available
        else [],
        "hpctrain": _hpctrain_version(),
        "packages": _packages(),
        "hosts": list(hosts),
        "argv": redact_argv(sys.argv),
        "env": _allowed_env(os.environ),
    }


def write_provenance(run_dir: RunDir, info: dict[str, Any]) -> None:
    """Write provenance/provenance.json and provenance/packages.txt (one `name==version` a line)."""
    make_dir(run_dir.provenance_dir)
    write_json_atomic(run_dir.provenance_dir / "provenance.json", info)
    packages = info.get("packages", [])
    write_atomic(run_dir.provenance_dir / "packages.txt",
                 "".join(f"{line}\n" for line in packages).encode("utf-8"))


def _git(*args: str) -> str | None:
    """Run git in the current directory; None when git is missing, slow, or this is no repo."""
    try:
        done = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git_dirty() -> bool | None:
    status = _git("status", "--porcelain")
    return None if status is None else bool(status)


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    # torch returns a tuple such as (2, 21, 5) on recent versions, an int on old ones.
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _hpctrain_version() -> str:
    try:
        return importlib.metadata.version("hpctrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _packages() -> list[str]:
    found: set[str] = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:  # broken installs leave metadata without a name
            found.add(f"{name}=={dist.version}")
    return sorted(found, key=str.lower)


def _allowed_env(environ: Mapping[str, str]) -> dict[str, str]:
    allowed = {
        name: value
        for name, value in environ.items()
        if name in _ENV_ALLOW or name.startswith(_ENV_ALLOW_PREFIX)
    }
    # A value can still hold a URI with a password (NCCL_..._URL=https://u:p@host).
    return {name: redact_text(allowed[name]) for name in sorted(allowed)
            if not SECRET_WORDS.search(name)}
