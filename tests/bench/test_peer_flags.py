"""The peer's command lines parse with torchtitan 0.2.2's own config manager and set what the
harness means, before a lease is spent on them.

An unknown flag costs a lease step; a default the peer applies silently costs a wrong
comparison: until ``--quantize.linear.float8.filter_fqns=output`` was passed, torchtitan's command
line converted its output layer to float8 too, where ours stays bf16, and every fp8 ratio
recorded was in its favour. Here every layout's peer run (compare.py's ``LAYOUTS``) and the
runs ``--set`` derives from the FSDP layouts go through torchtitan's parser
(``parse_peer_argv.py``) and the parsed settings are checked against the run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Where `make test` installs torchtitan 0.2.2 (without its dependencies: only its config
# package is loaded), beside the environment's own packages rather than among them.
PEER_SITE = Path(sys.prefix) / "torchtitan-site"
# What --set derives from the FSDP layouts (compare.py's peer_following), as the lease scripts
# use it: float8 training, ZeRO-2, both.
DERIVED = {"fp8": ["train.precision=fp8"], "zero2": ["parallel.reshard_after_forward=false"],
           "fp8-zero2": ["train.precision=fp8", "parallel.reshard_after_forward=false"]}
FSDP_LAYOUTS = ("1b-fsdp2", "1b-fsdp4", "8b-fsdp2", "8b-fsdp4")


def _torchtitan_argv(run) -> list[str]:
    """torchtitan's own arguments of ``run`` (its work folder is a placeholder: parsing reads
    no file)."""
    argv = run.argv(Path("/nonexistent/work"))
    return argv[argv.index("torchtitan.train") + 1:]


def _parse(argvs: list[list[str]]) -> subprocess.CompletedProcess:
    """torchtitan's parse of each argv (parse_peer_argv.py: one JSON line each)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PEER_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(HERE / "parse_peer_argv.py")],
                          input=json.dumps(argvs), capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def parsed(compare) -> dict[str, tuple[object, dict]]:
    """Per run name: (its PeerRun, torchtitan's parsed settings), all parsed in one process."""
    runs = {name: layout.peer for name, layout in compare.LAYOUTS.items()}
    for name in FSDP_LAYOUTS:
        for tag, sets in DERIVED.items():
            runs[f"{name}+{tag}"] = compare.peer_following(compare.LAYOUTS[name], sets)[0]
    argvs = [_torchtitan_argv(run) for run in runs.values()]
    done = _parse(argvs)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(runs), done.stdout + done.stderr
    return {name: (run, json.loads(line)) for (name, run), line in zip(runs.items(), lines,
                                                                        strict=True)}


def test_every_peer_command_line_parses(compare, parsed) -> None:
    errors = {name: got["error"] for name, (_, got) in parsed.items() if "error" in got}
    assert not errors, errors
    assert len(parsed) == len(compare.LAYOUTS) + len(FSDP_LAYOUTS) * len(DERIVED)


def test_the_parsed_settings_are_the_runs(parsed) -> None:
    for name, (run, got) in parsed.items():
        assert got["model"] == ["llama3", {"1b": "1b", "8b": "8B"}[run.size]], name
        assert (got["local_batch"], got["seq_len"], got["steps"]) == (
            run.local_batch, run.seq_len, run.steps), name
        assert (got["dp_shard"], got["dp_replicate"], got["tp"], got["pp"]) == (
            run.dp_shard, run.dp_replicate, run.tp, run.pp), name
        assert (got["dtype"], got["ac"], got["compile"]) == (run.dtype, run.ac, run.compile), name
        assert not got["checkpoint"] and not got["validation"], name
        if run.pp > 1:
            assert (got["pp_schedule"], got["pp_microbatch_size"]) == (
                run.pp_schedule, run.pp_microbatch_size), name


def test_float8_runs_keep_the_output_layer_in_bf16(parsed) -> None:
    """As ours does (parallel/float8.py); gathered in float8 with precomputed scales under FSDP,
    as ours are."""
    float8 = {name: got for name, (_, got) in parsed.items()
              if "quantize.linear.float8" in got["converters"]}
    assert sorted(float8) == sorted(f"{n}+{t}" for n in FSDP_LAYOUTS for t in DERIVED
                                    if "fp8" in t)
    for name, got in float8.items():
        assert got["float8_filter"] == ["output"], name
        assert got["float8_all_gather"] and got["float8_precompute"], name


def test_zero2_runs_never_reshard_and_the_rest_keep_the_default(parsed) -> None:
    for name, (_, got) in parsed.items():
        assert got["reshard"] == ("never" if "zero2" in name else "default"), name


def test_without_an_fsdp_dimension_tp_and_pp_run_pure_bf16(parsed) -> None:
    """torchtitan turns its mixed precision off with TP or PP and no FSDP: with fp32 parameters
    it would compute in fp32 (FIELD_NOTES)."""
    for name, (run, got) in parsed.items():
        if (run.tp > 1 or run.pp > 1) and run.dp_shard == 1:
            assert got["dtype"] == "bfloat16", name
        if run.dp_shard != 1:  # FSDP (one GPU: AMP): fp32 masters, bf16 compute, as ours
            assert (got["dtype"], got["param_dtype"], got["reduce_dtype"]) == (
                "float32", "bfloat16", "float32"), name


def test_a_flag_torchtitan_does_not_know_is_reported(compare) -> None:
    """The check above can fail: a misspelt flag comes back as the parser's error."""
    argv = _torchtitan_argv(compare.LAYOUTS["1b-1gpu"].peer)
    argv[argv.index("--training.seq_len")] = "--training.seqlen"
    done = _parse([argv])
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert "training.seqlen" in got["error"]
