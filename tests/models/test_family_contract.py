"""What every registered model family promises (``hpctrain.models.spec``), checked on every
preset built on the meta device: the counts match the model built, the named structure exists,
the tensor-parallel plan and the Hugging Face names address real modules and parameters.

A new family (e.g. a second LLM family) is checked here by registering it, nothing more."""

from __future__ import annotations

import pytest
from torch import nn

from hpctrain.models.registry import families

CASES = [(family, size) for family in families().values() for size in family.presets]


@pytest.fixture(params=CASES, ids=[f"{f.name}-{s}" for f, s in CASES])
def built(request):
    family, size = request.param
    args = family.presets[size]
    family.check_args(args)
    return family, args, family.build(args)


def test_the_counts_are_the_models(built) -> None:
    family, args, model = built
    assert isinstance(model, family.model_class) and model.args == args
    params = list(model.parameters())  # unique: a tied weight once
    assert all(p.is_meta for p in params)
    assert family.count_params(args, include_embedding=True) == sum(p.numel() for p in params)
    if family.plan_memory:
        assert family.param_tensors(args) == len(params)


def test_the_named_structure_exists(built) -> None:
    family, args, model = built
    blocks = family.block_list(model)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == args.n_layers
    for name in (*family.first, *family.last):
        assert isinstance(getattr(model, name), nn.Module)
    units = family.fsdp_modules(model)
    assert units and all(isinstance(u, nn.Module) for u in units)


def test_the_tensor_plan_addresses_real_modules(built) -> None:
    family, _, model = built
    if family.tensor_plan is None:
        pytest.skip(f"{family.name} has no tensor-parallel plan")
    plan = family.tensor_plan()
    for name in plan.root:
        model.get_submodule(name)
    for name in plan.block:
        family.block_list(model)[0].get_submodule(name)


def test_the_hugging_face_names_cover_every_parameter(built) -> None:
    family, args, model = built
    if family.hf is None:
        pytest.skip(f"{family.name} has no Hugging Face mapping")
    ours = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert family.hf.shapes(args) == ours
    for name in ours:
        assert family.hf.to_ours(family.hf.to_hf(name)) == name


def test_an_architecture_is_routed_to_one_family() -> None:
    """Which family an unnamed Hugging Face folder imports into must not depend on the order
    families register: a second family routing an architecture another routes is refused (it
    may read it when named, through ``also_reads``)."""
    import dataclasses

    from hpctrain.models.registry import family_for_hf, get_family, register, unregister

    qwen = get_family("qwen")
    claims = dataclasses.replace(qwen, name="claims_llama", hf=dataclasses.replace(
        qwen.hf, architectures={"LlamaForCausalLM": "llama"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.* 'llama' family routes already"):
        register(claims)
    assert "claims_llama" not in families()
    reads = dataclasses.replace(qwen, name="reads_llama", hf=dataclasses.replace(
        qwen.hf, architectures={}, also_reads={"LlamaForCausalLM": "llama"}))
    try:
        register(reads)
        raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        assert family_for_hf(raw, "config.json").name == "llama"
        assert family_for_hf(raw, "config.json", "reads_llama") is reads
    finally:
        unregister("reads_llama")
