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

from hpctrain import __version__
from hpctrain.bench import cli as bench_cli
from hpctrain.bench.tune import cli as tune_cli
from hpctrain.data.cli import add_parser as add_data_parser
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.launch import doctor as doctor_cli
from hpctrain.launch import k8s as k8s_cli
from hpctrain.launch import pipeline as pipeline_cli
from hpctrain.launch import sbatch as sbatch_cli
from hpctrain.launch import submit as submit_cli
from hpctrain.numeric_args import count
from hpctrain.observe import cli as observe_cli
from hpctrain.plan import cli as plan_cli
from hpctrain.pretrained import cli as pretrained_cli
from hpctrain.runtime.interrupted import INTERRUPTED, Interrupted
from hpctrain.runtime.runlock import TOKEN_ENV
from hpctrain.shown import shown

DESCRIPTION = """\
Train PyTorch models from one CPU process or GPU to a Slurm cluster: fast, restartable and
measurable. Every command takes a YAML config and KEY=VALUE overrides in any order."""

EPILOG = """\
first steps:
  hpctrain train configs/demo.yaml train.steps=20        train the tiny demo model on the CPU
  hpctrain runs runs/                                    what every run did
  hpctrain COMMAND --help                                a command's options and defaults

documentation: README.md and docs/ in the hpctrain repository"""


class _Parser(argparse.ArgumentParser):
    """Options and positional lists in any order, in every subcommand.

    argparse fills a positional list (KEY=VALUE overrides, input files) only up to the first
    option, so ``train CFG --nproc 2 k=v`` fails; ``parse_intermixed_args`` lifts that but
    refuses parsers with subcommands. So each leaf parser (no subcommands of its own) parses
    intermixed, and the parsers above it dispatch as usual. Subparsers inherit this class.
    """

    _intermixing = False

    def error(self, message: str):
        """argparse's usage error, with the words it echoes from the command line escaped."""
        super().error(shown(message, None))

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

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (has_default(action) and "%(default)" not in text
                and "default" not in text.lower()):
            text += " (default: %(default)s)"
        return text


def has_default(action: argparse.Action) -> bool:
    """True when an option has a default worth printing (not None, off, empty or hidden)."""
    default = action.default
    return (bool(action.option_strings) and default is not argparse.SUPPRESS
            and default is not None and default is not False and default != []
            and not isinstance(action, argparse._HelpAction | argparse._VersionAction))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpctrain", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}",
                   help="print hpctrain's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands")

    t = sub.add_parser("train", help="train a model from a YAML config or a task file",
                       description="Train a model. Overrides are dotted keys: train.steps=100.")
    t.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml, or a task "
                   "file defining task() (your own model, data and loss: hpctrain.task)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    t.add_argument("--nproc", type=count(1, 1 << 20), default=None,
                   help="start this many local ranks (one per GPU, or CPU processes)")
    t.add_argument("--max-restarts", type=count(0, 10_000), default=0,
                   help="with --nproc: restart the group this many times after a rank dies")
    t.add_argument("--resume", default=None, metavar="auto|never|PATH",
                   help="resume from the newest valid checkpoint of this run (auto, the "
                   "default: rerunning a command continues its run), refuse to start if the "
                   "run has checkpoints (never), or start from a checkpoint directory")
    t.add_argument("--fresh", action="store_true",
                   help="start this run over: an existing run directory of the same name is "
                   "archived as <name>-archived-<time> (never deleted) first")

    sbatch_cli.add_parser(sub)
    submit_cli.add_parser(sub)
    pipeline_cli.add_parser(sub)
    doctor_cli.add_parser(sub)
    k8s_cli.add_parser(sub)

    c = sub.add_parser("config", help="print the resolved config (defaults + file + overrides)")
    c.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    add_data_parser(sub)
    bench_cli.add_parser(sub)
    tune_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    observe_cli.add_parser(sub)  # report, runs, profile
    pretrained_cli.add_import_parser(sub)
    pretrained_cli.add_export_parser(sub)
    pretrained_cli.add_generate_parser(sub)
    pretrained_cli.add_eval_parser(sub)
    return p


def _train(args: argparse.Namespace) -> None:
    from hpctrain.task import load_run_config

    if args.resume is not None:
        args.overrides = [*args.overrides, f"checkpoint.resume={args.resume}"]
    # Only a task file's config depends on the world size (it picks ddp for several ranks).
    world = _world_size(args.nproc) if args.config.suffix == ".py" else 1
    cfg = load_run_config(args.config, args.overrides, world)
    if args.nproc is None:
        from hpctrain.train.job import run_training

        run_training(cfg, source=args.config, fresh=args.fresh)
        return

    from hpctrain.launch.local import launch_training

    launch_training(cfg, args.config, args.overrides, args.nproc,
                    max_restarts=args.max_restarts, fresh=args.fresh)


def _world_size(nproc: int | None) -> int:
    """The ranks a task file's run will have: --nproc (the ranks this command starts, even
    inside an srun step of one task), else torchrun's WORLD_SIZE, else srun's task count, else
    1."""
    if nproc is not None:
        return nproc
    value = os.environ.get("WORLD_SIZE")
    if value is None:
        from hpctrain.runtime.env import detect_env

        env = detect_env()  # a task of srun (a batch script's) sets no WORLD_SIZE
        return env.world_size if env.launcher == "slurm" else 1
    try:
        return count(1, 1 << 20)(value)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"WORLD_SIZE={shown(value)} in the environment: {e}",
                          hint="unset it, or start the ranks with torchrun or srun") from None


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
        {"train": _train, "config": _config, "data": lambda a: a.handler(a),
         "bench": bench_cli.run, "plan": plan_cli.run,
         "tune": lambda a: a.handler(a),
         "sbatch": lambda a: a.handler(a),
         "submit": lambda a: a.handler(a),
         "pipeline": lambda a: a.handler(a),
         "doctor": lambda a: a.handler(a),
         "k8s": lambda a: a.handler(a),
         "report": observe_cli.run, "runs": observe_cli.run, "profile": observe_cli.run,
         "import": pretrained_cli.run, "export": pretrained_cli.run,
         "generate": pretrained_cli.run, "eval": pretrained_cli.run,
         }[args.command](args)
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
        # render() is escaped (HpctrainError escapes its parts): no raw control character.
        print(f"hpctrain: error: {e.render()}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
