"""The Llama family: a pre-norm decoder of grouped-query attention with RoPE and a SwiGLU FFN
(Llama 2/3, and the Mistral and Qwen2 checkpoints that share its computation).

    model.py      the network (`Transformer`), its KV cache
    sizes.py      `ModelArgs` (the shape), the named presets, shape rules
    flops.py      parameter counts, FLOPs per token, stage costs, selective-AC recomputation
    tp_plan.py    the tensor-parallel plan
    hf_config.py  Hugging Face config.json <-> ModelArgs
    hf_names.py   Hugging Face tensor names and layouts

Everything the rest of hpctrain knows about it is `FAMILY`.
"""

from __future__ import annotations

from hpctrain.models.llama import flops, hf_config, hf_names, sizes, tp_plan
from hpctrain.models.llama.model import KVCache, Transformer, kv_cache
from hpctrain.models.llama.sizes import PRESETS, ModelArgs
from hpctrain.models.spec import HFMapping, ModelFamily

FAMILY = ModelFamily(
    name="llama",
    args_class=ModelArgs,
    model_class=Transformer,
    presets=PRESETS,
    blocks="layers",
    first=("tok_embeddings",),
    last=("norm", "output"),
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
        to_ours=hf_names.to_hpctrain_name,
        to_hf=hf_names.to_hf_name,
        shapes=hf_names.expected_shapes,
        permuted_heads=hf_names.rotary_heads,
        from_hf_rows=hf_names.from_hf_rows,
        to_hf_rows=hf_names.to_hf_rows,
        derived=hf_names.is_derived,
        tied=("output.weight",),
    ),
    kv_cache=kv_cache,
)

__all__ = ["FAMILY", "PRESETS", "KVCache", "ModelArgs", "Transformer"]
