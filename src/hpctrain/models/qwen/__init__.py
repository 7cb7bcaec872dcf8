"""The Qwen family: Qwen2/Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, a head
width of its own), tied embeddings on the small sizes; one network with two flags
(``QwenArgs.qkv_bias``, ``qk_norm``), since the generations differ only there.

    sizes.py      `QwenArgs` (the shape), presets (tiny, qwen2.5-0.5b, qwen3-0.6b, ...)
    model.py      the network (`QwenModel`)
    flops.py      parameter counts, FLOPs per token, stage costs, selective-AC recomputation
    tp_plan.py    the tensor-parallel plan
    hf_config.py  Hugging Face config.json <-> QwenArgs
    hf_names.py   Hugging Face tensor names

    hpctrain train configs/demo.yaml model.family=qwen     # the tiny preset on CPU
"""

from __future__ import annotations

from hpctrain.models.qwen import flops, hf_config, hf_names, sizes, tp_plan
from hpctrain.models.qwen.model import QwenModel, kv_cache
from hpctrain.models.qwen.sizes import PRESETS, QwenArgs
from hpctrain.models.spec import HFMapping, ModelFamily

FAMILY = ModelFamily(
    name="qwen",
    args_class=QwenArgs,
    model_class=QwenModel,
    presets=PRESETS,
    blocks="blocks",
    first=("embed",),
    last=("final_norm", "head"),
    check_args=sizes.check_args,
    args_from_json=sizes.args_from_json,
    count_params=flops.count_params,
    flops_per_token=flops.flops_per_token,
    stage_costs=flops.stage_costs,
    recomputed_flops=flops.recomputed_flops,
    param_tensors=flops.param_tensors,
    tensor_plan=tp_plan.tensor_plan,
    tp_splits=tp_plan.tp_splits,
    chunked_loss=True,
    plan_memory=True,
    hf=HFMapping(
        architectures=hf_config.ARCHITECTURES,
        args_from_config=hf_config.args_from_hf_config,
        config_from_args=hf_config.hf_config_from_args,
        max_seq_len_limit=hf_config.max_seq_len_limit,
        to_ours=hf_names.to_ours,
        to_hf=hf_names.to_hf,
        shapes=hf_names.shapes,
        permuted_heads=hf_names.permuted_heads,
        from_hf_rows=hf_names.same_rows,
        to_hf_rows=hf_names.same_rows,
        derived=hf_names.is_derived,
        tied=("head.weight",),
        also_reads=hf_config.ALSO_READS,
    ),
    kv_cache=kv_cache,
)

__all__ = ["FAMILY", "PRESETS", "QwenArgs", "QwenModel"]
