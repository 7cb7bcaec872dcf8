"""The ``hpctrain`` command. Subcommands parse arguments and delegate; no logic lives here.

    hpctrain train configs/demo.yaml --nproc 2 train.steps=100
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from hpctrain.bench import cli as bench_cli
from hpctrain.data.cli import add_parser as add_data_parser
from hpctrain.errors import HpctrainError
from hpctrain.plan import cli as plan_cli
from hpctrain.runtime.interrupted import INTERRUPTED, Interrupted
from hpctrain.runtime.runlock import TOKEN_ENV


class _Parser(argparse.ArgumentParser):
    """Options and positional lists in any order, in every subcommand.

    argparse fills a positional list (KEY=VALUE overrides, input files) only up to the first
    option, so ``train CFG --nproc 2 k=v`` fails; ``parse_intermixed_args`` lifts that but
    refuses parsers with subcommands. So each leaf parser (no subcommands of its own) parses
    intermixed, and the parsers above it dispatch as usual. Subparsers inherit this class.
    """

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        """argparse's parse_known_args, intermixed in a leaf parser."""
        if self._subparsers is not None or self._intermixing:
            return super().parse_known_args(args, namespace)
        # parse_known_intermixed_args calls parse_known_args twice (options, then positionals).
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpctrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train a model. Overrides are dotted keys: train.steps=100.")
    t.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    t.add_argument("--nproc", type=int, default=None,
                   help="start this many local ranks (one per GPU, or CPU processes)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart the group this many times after a rank dies")
    t.add_argument("--resume", default=None, metavar="auto|never|PATH",
                   help="resume from the newest valid checkpoint of this run (auto, the "
                   "default: rerunning a command continues its run), refuse to start if the "
                   "run has checkpoints (never), or start from a checkpoint directory")
    t.add_argument("--fresh", action="store_true",
                   help="start this run over: an existing run directory of the same name is "
                   "archived as <name>-archived-<time> (never deleted) first")

    s = sub.add_parser("sbatch", help="write a Slurm batch script for a training config",
                       description="Print a batch script with preemption manners "
                       "(--signal without B:, --requeue, exit 75 = requeue) that runs as "
                       "written: the job works in this directory, with this interpreter, "
                       "and its log folder is created now.")
    s.add_argument("config", type=Path)
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    for flag, kind, default in (("--nodes", int, 1), ("--tasks-per-node", int, 1),
                                ("--gpus-per-node", int, 0), ("--cpus-per-task", int, 1),
                                ("--time", str, "01:00:00"), ("--signal-lead-s", int, 120),
                                ("--job-name", str, "hpctrain"),
                                ("--log-dir", str, "runs/slurm-logs")):
        s.add_argument(flag, type=kind, default=default)
    for flag in ("--partition", "--account", "--array"):
        s.add_argument(flag, default=None)
    interpreter = s.add_mutually_exclusive_group()
    interpreter.add_argument("--python", default=None, metavar="PATH",
                             help="the job's Python, which must import hpctrain (default: the "
                             "one running this command)")
    interpreter.add_argument("--venv", default=None, metavar="DIR",
                             help="run the job with DIR/bin/python")
    s.add_argument("-o", "--output", type=Path, default=None, help="write here, not stdout")

    c = sub.add_parser("config", help="print the resolved config (defaults + file + overrides)")
    c.add_argument("config", type=Path)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    add_data_parser(sub)
    bench_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    return p


def _train(args: argparse.Namespace) -> None:
    from hpctrain.config import load_config

    if args.resume is not None:
        args.overrides = [*args.overrides, f"checkpoint.resume={args.resume}"]
    cfg = load_config(args.config, args.overrides)
    if args.nproc is None:
        from hpctrain.train.job import run_training

        run_training(cfg, source=args.config, fresh=args.fresh)
        return

    from hpctrain.launch.local import launch_training

    launch_training(cfg, args.config, args.overrides, args.nproc,
                    max_restarts=args.max_restarts, fresh=args.fresh)


def _sbatch(args: argparse.Namespace) -> None:
    from hpctrain.config import load_config
    from hpctrain.launch.sbatch import (
        SbatchParams,
        create_log_dir,
        render_sbatch,
        resolve_python,
    )

    load_config(args.config, args.overrides)  # a bad config fails here, not on the cluster
    workdir = Path.cwd()
    params = SbatchParams(
        config=str(args.config), workdir=str(workdir),
        python=resolve_python(args.python, args.venv, workdir), overrides=args.overrides,
        job_name=args.job_name, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
        signal_lead_s=args.signal_lead_s, partition=args.partition, account=args.account,
        array=args.array, log_dir=args.log_dir)
    text = render_sbatch(params)
    logs = create_log_dir(params)
    if args.output is None:
        print(text, end="")
    else:
        args.output.write_text(text)
        print(f"wrote {args.output} (logs go to {logs}/); submit it with: sbatch {args.output}",
              file=sys.stderr)


def _config(args: argparse.Namespace) -> None:
    from hpctrain.config import dump_yaml, load_config

    print(dump_yaml(load_config(args.config, args.overrides)), end="")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as a namespace; options and positionals may come in any order."""
    return _parser().parse_args(argv)


@record
def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hpctrain`` console script."""
    args = parse_args(argv)
    try:
        {"train": _train, "config": _config, "sbatch": _sbatch, "data": lambda a: a.handler(a),
         "bench": bench_cli.run, "plan": plan_cli.run}[args.command](args)
    except Interrupted as e:
        if TOKEN_ENV not in os.environ:  # a rank of our launcher: the launcher says it once
            print(e.line(), file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit now: threads of the interrupted step (collectives, a checkpoint write) make the
        # interpreter's teardown abort (std::terminate), and nothing is left to clean up: the
        # exit info is written, the lock released, the last checkpoint committed or untouched.
        os._exit(e.exit_code)
    except KeyboardInterrupt:
        print("hpctrain: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except HpctrainError as e:
        print(f"hpctrain: error: {e.render()}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
