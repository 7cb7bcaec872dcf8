"""The ``hpctrain`` command. Subcommands parse arguments and delegate; no logic lives here.

    hpctrain train configs/demo.yaml --nproc 2 train.steps=100
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import logging
import os
import sys
from collections.abc import Callable, Collection
from pathlib import Path

from hpctrain import __version__
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.numeric_args import count
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


# The commands in the order `hpctrain --help` lists them, with their line there (each is also
# the help its module registers: tests/test_cli_help.py checks they agree).
COMMANDS = {
    "train": "train a model from a YAML config or a task file",
    "sbatch": "write a Slurm batch script for a training config",
    "submit": "write the batch script and submit it to Slurm",
    "pipeline": "submit a chain of Slurm jobs from a YAML file",
    "doctor": "preflight: check nodes, GPUs, network, disk before a job",
    "k8s": "Kubernetes manifests for a multi-node training job",
    "config": "print the resolved config (defaults + file + overrides)",
    "data": "prepare and check token shards",
    "bench": "benchmark GEMM, memory, host<->device and collectives",
    "tune": "measure a short list of configurations, keep the fastest",
    "plan": "memory, parallel layout, budget, checkpoint interval",
    "report": "one self-contained HTML report of one or several runs",
    "runs": "a table of runs: state, step, loss, tokens/s, goodput",
    "profile": "where the GPU time of profiled steps went",
    "import": "convert a Hugging Face model into an hpctrain checkpoint",
    "export": "write a checkpoint as a Hugging Face model folder",
    "generate": "continue a prompt with a model (greedy or sampled)",
    "eval": "perplexity of a model on a prepared split",
}
# "module:function" that adds each command's parser (observe's adds report, runs and profile).
# Only the command being run is imported: most of these modules import torch (~1.5 s), which
# `hpctrain --help`, `--version` or a typo need not wait for.
_ADDERS = {
    "train": "hpctrain.cli:_add_train",
    "sbatch": "hpctrain.launch.sbatch:add_parser",
    "submit": "hpctrain.launch.submit:add_parser",
    "pipeline": "hpctrain.launch.pipeline:add_parser",
    "doctor": "hpctrain.launch.doctor:add_parser",
    "k8s": "hpctrain.launch.k8s:add_parser",
    "config": "hpctrain.cli:_add_config",
    "data": "hpctrain.data.cli:add_parser",
    "bench": "hpctrain.bench.cli:add_parser",
    "tune": "hpctrain.bench.tune.cli:add_parser",
    "plan": "hpctrain.plan.cli:add_parser",
    **dict.fromkeys(("report", "runs", "profile"), "hpctrain.observe.cli:add_parser"),
    "import": "hpctrain.pretrained.cli:add_import_parser",
    "export": "hpctrain.pretrained.cli:add_export_parser",
    "generate": "hpctrain.pretrained.cli:add_generate_parser",
    "eval": "hpctrain.pretrained.cli:add_eval_parser",
}
# "module:function" that runs a command whose parser sets no ``handler``.
_RUNNERS = {
    "train": "hpctrain.cli:_train",
    "config": "hpctrain.cli:_config",
    "bench": "hpctrain.bench.cli:run",
    "plan": "hpctrain.plan.cli:run",
    **dict.fromkeys(("report", "runs", "profile"), "hpctrain.observe.cli:run"),
    **dict.fromkeys(("import", "export", "generate", "eval"), "hpctrain.pretrained.cli:run"),
}


def command_modules() -> list[str]:
    """The modules of every command: what a process that runs many commands (the tests' fork
    server) imports once, up front."""
    return sorted({adder.split(":")[0] for adder in _ADDERS.values()})


def _load(target: str) -> Callable:
    """The function a "module:function" string names, its module imported."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``hpctrain`` parser with ``commands`` (None: all) built in full; every other
    command is only its name and help line, its module not imported."""
    p = _Parser(prog="hpctrain", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}",
                   help="print hpctrain's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands")
    full = {_ADDERS[c] for c in (COMMANDS if commands is None else commands)}
    added: set[str] = set()
    for name, help_line in COMMANDS.items():
        adder = _ADDERS[name]
        if adder not in full:
            sub.add_parser(name, help=help_line)
        elif adder not in added:
            _load(adder)(sub)
            added.add(adder)
    return p


def _add_train(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain train``."""
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


def _add_config(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain config``."""
    c = sub.add_parser("config", help="print the resolved config (defaults + file + overrides)")
    c.add_argument("config", type=Path, help="YAML config, e.g. configs/demo.yaml")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


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
    argv = sys.argv[1:] if argv is None else argv
    # The top level's options take no value: its first other word is the command.
    command = next((word for word in argv if not word.startswith("-")), None)
    return _parser({command} & COMMANDS.keys()).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hpctrain`` console script."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        # A rank under torch elastic's agent (--nproc, torchrun): record() writes why it
        # failed to the file the agent reads back (the launcher's exit_info names it).
        from torch.distributed.elastic.multiprocessing.errors import record

        record(_main)(argv)
        return
    # A crash's Python stack on stderr, as record() enables; not where stderr is no file.
    with contextlib.suppress(OSError, ValueError):
        faulthandler.enable(all_threads=True)
    _main(argv)


def _main(argv: list[str] | None) -> None:
    args = parse_args(argv)
    runner = _RUNNERS.get(args.command)
    try:
        (_load(runner) if runner else args.handler)(args)
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
