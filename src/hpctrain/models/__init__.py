"""Built-in Llama-style decoder, its named sizes, and its parameter/FLOP accounting."""

from hpctrain.models.config import ModelConfig
from hpctrain.models.flops import count_params, flops_per_token
from hpctrain.models.llama import Transformer, TransformerBlock
from hpctrain.models.sizes import PRESETS, ModelArgs

__all__ = [
    "PRESETS",
    "ModelArgs",
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "count_params",
    "flops_per_token",
]
