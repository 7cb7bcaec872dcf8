"""Parse torchtitan command lines with torchtitan's own config manager; print what they set.

    PYTHONPATH=.venv/torchtitan-site python tests/bench/parse_peer_argv.py < argvs.json
    # argvs.json: a JSON list of argv lists; `make test` installs torchtitan 0.2.2 there

Prints one JSON object per argv, in order: the parsed settings that the peer harness relies on,
or ``{"error": ...}`` with what the parser said. Run as its own process: torchtitan's package
``__init__`` imports its MoE kernels, hence triton, which a CPU machine lacks, so only its
``config`` package is loaded, under an empty ``torchtitan`` package made here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import types


def _load_config_manager():
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torchtitan is not importable: `make test` installs torchtitan==0.2.2, "
                 "without its dependencies, into .venv/torchtitan-site")
    package = types.ModuleType("torchtitan")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchtitan"] = package
    from torchtitan.config import ConfigManager

    return ConfigManager


def _settings(c) -> dict:
    p, t, f8 = c.parallelism, c.training, c.quantize.linear.float8
    return {
        "model": [c.model.name, c.model.flavor], "converters": list(c.model.converters),
        "local_batch": t.local_batch_size, "seq_len": t.seq_len, "steps": t.steps,
        "dtype": t.dtype, "param_dtype": t.mixed_precision_param,
        "reduce_dtype": t.mixed_precision_reduce, "ac": c.activation_checkpoint.mode,
        "compile": c.compile.enable, "dp_shard": p.data_parallel_shard_degree,
        "dp_replicate": p.data_parallel_replicate_degree, "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree, "pp_schedule": p.pipeline_parallel_schedule,
        "pp_microbatch_size": p.pipeline_parallel_microbatch_size,
        "reshard": p.fsdp_reshard_after_forward, "float8_filter": list(f8.filter_fqns),
        "float8_all_gather": f8.enable_fsdp_float8_all_gather,
        "float8_precompute": f8.precompute_float8_dynamic_scale_for_fsdp,
        "checkpoint": c.checkpoint.enable, "validation": c.validation.enable,
    }


def main() -> None:
    manager = _load_config_manager()
    for argv in json.load(sys.stdin):
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                config = manager().parse_args(argv)
        except SystemExit:
            print(json.dumps({"error": said.getvalue()[-3000:]}))
            continue
        print(json.dumps(_settings(config)))


if __name__ == "__main__":
    main()
