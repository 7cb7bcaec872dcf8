r"""Bring your own model: import Hugging Face weights, export them back, sample, evaluate.

    hpctrain import hf /models/Llama-3.2-1B --out ckpt/llama-3.2-1b     # once, optional
    hpctrain data prepare chats.jsonl --format chat --tokenizer /models/Llama-3.2-1B --out data/chat
    hpctrain train configs/finetune-llama.yaml model.init_from=hf:/models/Llama-3.2-1B \
        data.source=shards data.path=data/chat
    hpctrain export hf runs/finetune-llama --out exported/    # its latest checkpoint
    hpctrain generate runs/finetune-llama --chat --prompt "What is 2 + 2?"
    hpctrain eval runs/finetune-llama                           # the run's held-out split

The model side (config mapping, weight names, RoPE layout, KV cache) lives in
`hpctrain.models`; sharded loading in `hpctrain.parallel.materialize`.
"""
