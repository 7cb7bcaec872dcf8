"""Run the job's program inside a container: Apptainer (``apptainer exec``) or Pyxis/enroot
(``srun --container-image``), with the host folders the job reads and writes bound in.

    hpctrain submit configs/llama-1b.yaml --container /images/hpctrain.sif ...
    hpctrain submit configs/llama-1b.yaml --container nvcr.io#nvidia/pytorch:25.01-py3 \\
        --container-runtime pyxis --python /opt/venv/bin/python ...

Only the program runs in the container: ``srun`` and the batch script stay on the host, so the
preemption protocol needs nothing from the image. Inside, ``scontrol`` is usually missing:
rank 0 then prints ``HPCTRAIN_REQUEUE_BY_SCRIPT`` into the job log (the container's stdout is
the log, written on the host), exits 75, and the batch script requeues the job from outside.

Folders bound at the same path inside: the working folder, the log folder, ``run.out_dir``,
``data.path`` (or each ``data.mix`` path) and ``data.stage_to`` when they lie outside those,
any ``--bind DIR``, and ``$SLURM_TMPDIR`` when the job has one. The interpreter is the image's
(``python3`` unless ``--python`` names one inside it). Images: ``containers/`` builds one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.runtime.redact import redact_uri, uri_secrets

Runtime = Literal["apptainer", "pyxis"]
# The separators of apptainer --bind and pyxis --container-mounts lists.
_SEPARATORS = (",", ":")


@dataclass
class Container:
    """An image, the runtime that starts it, and the host folders it sees."""

    image: str
    runtime: Runtime = "apptainer"
    binds: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Binds must be absolute paths a bind list can carry."""
        if not self.image.strip():
            raise ConfigError("--container is empty", expected="an image: a .sif file, "
                              "docker://..., or for pyxis a .sqsh file or registry#image")
        secrets = uri_secrets(self.image)
        if secrets:  # the image is written into the job script, which others can read
            raise ConfigError(
                f"--container {redact_uri(self.image)!r} holds a credential "
                f"({', '.join(secrets)})", expected="an image reference without credentials",
                hint="log in to the registry instead: apptainer registry login (or export "
                "APPTAINER_DOCKER_USERNAME and APPTAINER_DOCKER_PASSWORD); for pyxis, "
                "enroot's credentials file ($ENROOT_CONFIG_PATH/.credentials)")
        for b in self.binds:
            if not b.startswith("/") or any(c in b for c in _SEPARATORS):
                raise ConfigError(f"bind {b!r} cannot be passed to the container",
                                  expected="an absolute path without ',' or ':'",
                                  hint="move or link the folder to a plain path")

    def shell_setup(self) -> list[str]:
        """Batch-script lines that build the bind list (``$SLURM_TMPDIR`` known at run time)."""
        if self.runtime == "apptainer":
            value = ",".join(self.binds)
            extra = '"$binds,$SLURM_TMPDIR"'
        else:
            value = ",".join(f"{b}:{b}" for b in self.binds)
            extra = '"$binds,$SLURM_TMPDIR:$SLURM_TMPDIR"'
        return [
            "# Host folders the container sees at the same paths (working folder, logs, data,",
            "# runs, node-local scratch).",
            f"binds={shlex.quote(value)}",
            f'if [ -n "${{SLURM_TMPDIR:-}}" ]; then binds={extra}; fi',
        ]

    def srun_options(self, workdir: str) -> list[str]:
        """Options srun itself takes (Pyxis); none for Apptainer."""
        if self.runtime == "apptainer":
            return []
        return [f"--container-image={shlex.quote(self.image)}", '--container-mounts="$binds"',
                f"--container-workdir={shlex.quote(workdir)}"]

    def prefix(self, gpus: bool) -> list[str]:
        """What goes before the program on the srun line (already shell text)."""
        if self.runtime == "pyxis":
            return []
        return ["apptainer", "exec", *(["--nv"] if gpus else []), "--bind", '"$binds"',
                shlex.quote(self.image)]


def default_runtime(image: str) -> Runtime:
    """Pyxis for enroot images (``.sqsh``), Apptainer for everything else."""
    return "pyxis" if image.endswith(".sqsh") else "apptainer"


def job_binds(cfg: JobConfig, workdir: Path, log_dir: str, extra: list[str]) -> list[str]:
    """The host folders the job uses (working folder first), none inside another."""
    wanted = [workdir, Path(log_dir), Path(cfg.run.out_dir)]
    data = cfg.data
    if data.source == "shards" and data.path:
        wanted.append(Path(data.path))
    if data.source == "mix" and data.mix:
        wanted += [Path(m.path) for m in data.mix]
    if data.stage_to and Path(data.stage_to).is_absolute():
        wanted.append(Path(data.stage_to))
    wanted += [Path(e) for e in extra]
    folders = list(dict.fromkeys(str((workdir / w).absolute()) for w in wanted))

    def inside(f: str, k: str) -> bool:
        return f != k and f.startswith(k.rstrip("/") + "/")

    return [f for f in folders if not any(inside(f, k) for k in folders)]
