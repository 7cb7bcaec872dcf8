"""The model families hpctrain knows, by name (``model.family``).

    family = get_family("llama")        # ConfigError listing the registered names if unknown
    family = family_of(model)           # the family a built model (or pipeline stage) is of
    family = family_of_args(args)       # ... or a shape is of

Built-in families are imported the first time any is asked for; a user's family registers
itself with ``register(family)`` (before the config naming it is resolved). These look-ups run
while a model is built or planned, never per training step.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.models.spec import ModelFamily

# name -> the module whose FAMILY is that family: adding a built-in family is one line here.
BUILTIN = {
    "llama": "hpctrain.models.llama",
    "qwen": "hpctrain.models.qwen",
}
DEFAULT = "llama"

_FAMILIES: dict[str, ModelFamily] = {}
_loaded = False


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name, module in BUILTIN.items():
            if name not in _FAMILIES:
                register(importlib.import_module(module).FAMILY)


def register(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known by its name (a second family of that name is refused, as is one
    routing a Hugging Face architecture another family routes)."""
    _load_builtin()  # a user's family is checked against the built-in ones
    known = _FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"a model family named {family.name!r} is registered already")
    # Which family an unnamed folder imports into must not depend on the registration order.
    for other in _FAMILIES.values():
        if other is family or other.hf is None or family.hf is None:
            continue
        for arch in set(family.hf.architectures) & set(other.hf.architectures):
            raise ValueError(f"family {family.name!r} routes {arch}, which the {other.name!r} "
                             "family routes already; list it in its HFMapping.also_reads (read "
                             "when the family is named) instead")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Forget the family ``name`` (tests that register their own)."""
    _FAMILIES.pop(name, None)


def families() -> dict[str, ModelFamily]:
    """Every registered family by name."""
    _load_builtin()
    return dict(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; ConfigError listing the registered ones if none is."""
    _load_builtin()
    if name not in _FAMILIES:
        raise ConfigError(f"model.family = {name!r} is not a registered model family",
                          expected=f"one of {', '.join(sorted(_FAMILIES))}",
                          hint="register your own with hpctrain.models.registry.register "
                          "before the config is resolved")
    return _FAMILIES[name]


def family_of_args(args: Any) -> ModelFamily:
    """The family whose shape class ``args`` is an instance of."""
    _load_builtin()
    for family in _FAMILIES.values():
        if isinstance(args, family.args_class):
            return family
    raise TypeError(f"{type(args).__name__} is the shape of no registered model family")


def family_of(model: nn.Module) -> ModelFamily:
    """The family whose model class ``model`` is an instance of."""
    _load_builtin()
    for family in _FAMILIES.values():
        if isinstance(model, family.model_class):
            return family
    raise TypeError(f"{type(model).__name__} is the model of no registered model family")


def family_for_hf(raw: dict[str, Any], where: str, name: str | None = None,
                  asked_by: str = "model.family") -> ModelFamily:
    """The family that imports a Hugging Face ``config.json`` of this architecture: the one
    its architecture names, or the family ``name`` (asked for by ``asked_by``) if it reads it."""
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    supported = {}
    for family in families().values():
        if family.hf is not None:
            supported.update({a: (family, t) for a, t in family.hf.architectures.items()})
    if name is not None:
        return _named_family_for_hf(raw, where, arch, name, asked_by, supported)
    if isinstance(arch, str) and arch in supported:
        return supported[arch][0]
    raise ConfigError(
        f"{where}: architecture {arch!r} (model_type {raw.get('model_type')!r}) is not "
        "supported", expected=", ".join(f"{a} (model_type {t!r})"
                                        for a, (_, t) in supported.items()),
        hint="convert the model with its own tools, or train it with them")


def _named_family_for_hf(raw: dict[str, Any], where: str, arch: object, name: str,
                         asked_by: str, supported: dict[str, tuple[ModelFamily, str]]
                         ) -> ModelFamily:
    """The family ``name`` if it reads ``arch``; else a ConfigError saying which one does."""
    family = get_family(name)
    reads = {**family.hf.architectures, **family.hf.also_reads} if family.hf else {}
    if isinstance(arch, str) and arch in reads:
        return family
    own = supported.get(arch)[0].name if isinstance(arch, str) and arch in supported else None
    raise ConfigError(
        f"{where}: {asked_by} = {name!r}, but the folder holds a {arch!r} model (model_type "
        f"{raw.get('model_type')!r}), which the {name!r} family does not read",
        expected=(f"one of {', '.join(reads)}" if reads else
                  f"a family with a Hugging Face mapping (the {name!r} family has none)"),
        hint=(f"the {own!r} family reads it: set {asked_by} to {own!r}, or leave it out"
              if own else "convert the model with its own tools, or train it with them"))


def count_params(args: Any, *, include_embedding: bool) -> int:
    """Unique parameters of the model of shape ``args``, whatever its family."""
    return family_of_args(args).count_params(args, include_embedding=include_embedding)


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token of the model of shape ``args`` at ``seq_len``."""
    return family_of_args(args).flops_per_token(args, seq_len)
