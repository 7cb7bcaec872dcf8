"""The ``hpctrain`` command. Subcommands parse arguments and delegate; no logic lives here.

    hpctrain train configs/demo.yaml train.steps=100 --nproc 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from hpctrain.bench import cli as bench_cli
from hpctrain.data.cli import add_parser as add_data_parser
from hpctrain.errors import HpctrainError
from hpctrain.plan import cli as plan_cli


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpctrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train a model. Overrides are dotted keys: train.steps=100.")
    t.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    t.add_argument("--nproc", type=int, default=None,
                   help="start this many local ranks (one per GPU, or CPU processes)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart the group this many times after a rank dies")

    c = sub.add_parser("config", help="print the resolved config (defaults + file + overrides)")
    c.add_argument("config", type=Path)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    add_data_parser(sub)
    bench_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    return p


def _train(args: argparse.Namespace) -> None:
    from hpctrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.nproc is None:
        from hpctrain.train.job import run_training

        run_training(cfg, source=args.config)
        return

    from hpctrain.launch.local import launch_local
    from hpctrain.runtime.env import detect_env
    from hpctrain.train.job import resolve_run_dir

    # Resolve the name once here so every rank (and every restart) writes to one directory.
    run_id = time.strftime("%Y%m%d-%H%M%S")
    run_dir = resolve_run_dir(cfg, detect_env(), run_id=run_id)
    run_dir.create()
    worker_args = ["train", str(args.config), *args.overrides,
                   f"run.name={run_dir.root.name}", "run.suffix=none"]
    launch_local(args.nproc, worker_args, run_dir, run_id=run_id,
                 max_restarts=args.max_restarts)


def _config(args: argparse.Namespace) -> None:
    from hpctrain.config import dump_yaml, load_config

    print(dump_yaml(load_config(args.config, args.overrides)), end="")


@record
def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hpctrain`` console script."""
    args = _parser().parse_args(argv)
    try:
        {"train": _train, "config": _config, "data": lambda a: a.handler(a),
         "bench": bench_cli.run, "plan": plan_cli.run}[args.command](args)
    except HpctrainError as e:
        print(f"hpctrain: error: {e.render()}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
