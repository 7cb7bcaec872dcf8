"""Bring your own model: import Hugging Face weights, export them back, sample, evaluate.

    hpctrain import hf /models/Llama-3.2-1B --out ckpt/llama-3.2-1b     # once, optional
    hpctrain train configs/finetune-llama.yaml model.init_from=hf:/models/Llama-3.2-1B
    hpctrain export hf runs/finetune --out exported/                      # latest checkpoint
    hpctrain generate runs/finetune --prompt "The capital of France is"
    hpctrain eval runs/finetune --data data/chat --val-fraction 0.05

The model side (config mapping, weight names, RoPE layout, KV cache) lives in
`hpctrain.models`; sharded loading in `hpctrain.parallel.materialize`.
"""
