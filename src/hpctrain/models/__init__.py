"""Model families (``spec.py``: what hpctrain needs to know of one; ``registry.py``: which
exist), one folder per family (``llama/``), and the ``model:`` config section.

``ModelArgs``, ``PRESETS`` and ``Transformer`` are the default family's (Llama).
"""

from hpctrain.models.config import ModelConfig
from hpctrain.models.llama import PRESETS, ModelArgs, Transformer
from hpctrain.models.registry import (
    count_params,
    families,
    family_of,
    family_of_args,
    flops_per_token,
    get_family,
    register,
)
from hpctrain.models.spec import HFMapping, ModelFamily, TensorPlan

__all__ = [
    "PRESETS",
    "HFMapping",
    "ModelArgs",
    "ModelConfig",
    "ModelFamily",
    "TensorPlan",
    "Transformer",
    "count_params",
    "families",
    "family_of",
    "family_of_args",
    "flops_per_token",
    "get_family",
    "register",
]
