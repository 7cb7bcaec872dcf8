"""Start N ranks on this machine through PyTorch's elastic launcher (what torchrun runs).

The launcher resolves the run directory once and hands the same name to every rank, so nobody
writes a torchrun line and all ranks agree on where to write. When any rank fails, the elastic
agent stops the others (SIGTERM, then SIGKILL) and, within ``max_restarts``, starts the group
again; the failure is recorded in the run's ``exit_info.json``.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hpctrain.errors import LaunchError
from hpctrain.runtime.rundir import RunDir

log = logging.getLogger("hpctrain.launch")


def launch_local(nproc: int, worker_args: list[str], run_dir: RunDir, *, run_id: str,
                 max_restarts: int = 0) -> None:
    """Run ``python -m hpctrain <worker_args>`` as ``nproc`` ranks; raise LaunchError on failure."""
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc} must be >= 1")
    if "OMP_NUM_THREADS" not in os.environ:
        # Each rank's intra-op pool would otherwise take every core: N ranks x all cores spin
        # against each other (measured 10x slower on 2 cores with 2 ranks). torchrun sets 1;
        # an equal share of the cores keeps CPU ranks fast and leaves GPU ranks room for data.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        log.info("OMP_NUM_THREADS=%s per rank (%d ranks)", os.environ["OMP_NUM_THREADS"], nproc)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        # torchrun --standalone: a c10d store on a free local port, no etcd, no fixed port.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir.logs_dir / "launcher")),
    )
    try:
        elastic_launch(config, sys.executable)("-m", "hpctrain", *worker_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        reason = f"rank {rank} exited with code {failure.exitcode}"
        if failure.exitcode < 0:
            reason += f" ({failure.signal_name()})"
        run_dir.write_exit_info(exit_code=1, reason=reason, last_checkpoint=None,
                                extra={"failed_ranks": sorted(e.failures),
                                       "error_file": failure.error_file or None})
        raise LaunchError(
            f"training failed: {reason}",
            hint=f"see {run_dir.rank_log(rank)} and {run_dir.exit_info_path}",
        ) from None
