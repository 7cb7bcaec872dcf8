"""A model family: everything the rest of hpctrain needs to know about one kind of model.

One `ModelFamily` object per family (``models/llama/__init__.py`` defines Llama's), registered
by name in ``models/registry.py``. Parallelism, planning, training and the pretrained tools read
the family, never its layer names::

    family = get_family("llama")
    args = family.presets["1b"]          # a shape: the family's own frozen dataclass
    model = family.build(args)           # on the meta device
    family.flops_per_token(args, 2048)   # PaLM convention

What a family's shape (``args``) must have: ``n_layers`` (blocks), ``vocab_size`` (the data
loader refuses larger token ids; tensor parallelism splits the loss along it) and
``tie_embeddings``; it may have ``max_seq_len`` (longer sequences are refused; absent: no
limit). What its model must do:

- ``model.args`` is the shape it was built from;
- the repeated blocks are the entries of one ``nn.ModuleList`` attribute (``blocks``); they are
  the pipeline's cut points, the activation-checkpoint units, the FSDP units and what compile
  compiles, and each must take the residual stream (and whatever the model passes them) alone;
- the modules named in ``first`` run before the blocks, those in ``last`` after them; any of
  these, and any block, may be set to None (a pipeline stage holds only its own) and the
  forward then takes the hidden state instead of token ids, or returns it instead of logits;
- ``init_buffers()`` recomputes derived buffers after ``to_empty``, and
  ``init_parameter(name, tensor, generator)`` fills one whole parameter by its name (so every
  layout draws the same initial weights: ``hpctrain.parallel.materialize``);
- with ``chunked_loss`` the forward takes ``targets=`` and ``loss_chunks=`` and returns the
  summed token loss (``hpctrain.models.chunked_loss``).

Adding a family is a folder ``models/<name>/`` defining its `ModelFamily` and one line in
``registry.BUILTIN`` (or a call to ``registry.register`` from the user's code); parallelism,
planning, training and the pretrained tools need no change (``tests/models/test_toy_family.py``
trains a family registered from a test file alone). Three limits:

- a Hugging Face architecture is routed to one family (``HFMapping.architectures``; a second
  claim is refused at registration): another family reads it when named
  (``HFMapping.also_reads``, ``model.family`` / ``import hf --family``);
- the config overrides shape fields ``ModelConfig`` has (``model.dim``, ``model.n_layers``,
  ...); a field only the family's shape has (Qwen's ``head_dim``) comes from its presets.
- ``plan memory`` models a pre-norm GQA decoder with a gated FFN (``plan_memory``); a family
  of another structure is refused there, saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TensorPlan:
    """A family's tensor-parallel plan: ``ParallelStyle``s by module name, for the model's
    own modules (``root``; entries whose module a pipeline stage lacks are skipped) and for
    the modules of each block (``block``)."""

    root: Mapping[str, Any]
    block: Mapping[str, Any]


@dataclass(frozen=True)
class HFMapping:
    """How a family's models map to Hugging Face ``transformers`` ones (import, export,
    generate and eval of pretrained models).

    Tensor names go both ways (``to_ours``, ``to_hf``); ``shapes(args)`` lists every parameter
    of the model by our name (a tied output once) with its full shape; ``permuted_heads(name,
    args)`` says how many heads' rows are reordered between the two layouts for ``name``
    (None: stored alike), ``from_hf_rows`` / ``to_hf_rows`` reorder them.
    """

    # Hugging Face architecture -> its model_type: the folders ``import hf`` and ``init_from:
    # hf:DIR`` bring to this family when no family is named.
    architectures: Mapping[str, str]
    args_from_config: Callable[[dict[str, Any], str], Any]
    config_from_args: Callable[..., dict[str, Any]]
    max_seq_len_limit: Callable[[dict[str, Any]], int | None]
    to_ours: Callable[[str], str | None]
    to_hf: Callable[[str], str]
    shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    permuted_heads: Callable[[str, Any], int | None]
    from_hf_rows: Callable[[torch.Tensor, int], torch.Tensor]
    to_hf_rows: Callable[[torch.Tensor, int], torch.Tensor]
    # Tensors a Hugging Face folder may hold that are derived (recomputed), never read.
    derived: Callable[[str], bool] = lambda name: False
    # Our names of the tensors a tied model shares with another (its output layer's copy of
    # the embedding): present in a folder or not, never read.
    tied: tuple[str, ...] = ()
    # Architectures (-> model_type) this family also reads when asked for by name
    # (``model.family``, ``import hf --family``), though another family imports them by default.
    also_reads: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFamily:
    """One model family: build, sizes, counts, parallel plans, costs, pretrained mapping."""

    name: str
    args_class: type
    model_class: type[nn.Module]
    presets: Mapping[str, Any]
    # Structure, by attribute name of the model (see the module docstring).
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    # Shape rules beyond positivity (ConfigError naming the model.* keys).
    check_args: Callable[[Any], None]
    # The shape back from its JSON form (dataclasses.asdict), read as untrusted input.
    args_from_json: Callable[[object, str], Any]
    # Unique parameters (tied weights once); without the input embedding table if asked.
    count_params: Callable[..., int]
    # Training FLOPs per token at a sequence length (PaLM: 6N + attention).
    flops_per_token: Callable[[Any, int], float]
    # Modelled training cost per token (FLOP-equivalents) of (first parts, one block, last
    # parts) at (seq_len, tokens per micro-batch): what pipeline stages are balanced by.
    stage_costs: Callable[[Any, int, int], tuple[float, float, float]]
    # Matmul FLOPs per token one block recomputes under selective AC (``ac_save_mm``).
    recomputed_flops: Callable[[Any, str], float]
    # Tensor parallelism: the plan, and the sizes it splits, as (config key, value, why) that
    # tp must divide. None: the family refuses tensor parallelism.
    tensor_plan: Callable[[], TensorPlan] | None = None
    tp_splits: Callable[[Any, int], list[tuple[str, int, str]]] = lambda args, seq_len: []
    # The forward computes output layer and loss together over token chunks.
    chunked_loss: bool = False
    # Hugging Face mapping; None where the family has none.
    hf: HFMapping | None = None
    # An empty KV cache for generation: (model, batch, max_len) -> cache the forward takes as
    # ``cache=``. None: the family cannot generate.
    kv_cache: Callable[[nn.Module, int, int], Any] | None = None
    # Parameter tensors of a whole model (the planner's count of AdamW ``step`` tensors; read
    # only where ``plan_memory``).
    param_tensors: Callable[[Any], int] = lambda args: 0
    # The planner's memory model (``hpctrain.plan.memory``: a pre-norm decoder of grouped-query
    # attention and a gated FFN, its shape with dim, n_heads, n_kv_heads, head_dim, ffn_dim)
    # sizes this family's activations.
    plan_memory: bool = False
    # The modules FSDP shards one by one (grouped by ``parallel.fsdp_group_blocks``) before
    # the root, in forward order; None: the blocks.
    fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None

    def build(self, args: Any) -> nn.Module:
        """The model of shape ``args`` on the meta device (no storage allocated)."""
        with torch.device("meta"):
            return self.model_class(args)

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The model's blocks (entries may be None in a pipeline stage)."""
        return getattr(model, self.blocks)

    def fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` (or of a pipeline stage of it) FSDP shards before the root."""
        if self.fsdp_units is not None:
            return self.fsdp_units(model)
        return [block for block in self.block_list(model) if block is not None]
