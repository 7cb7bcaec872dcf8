"""The model-family boundary: outside its own folder (``models/llama/``, ``models/qwen/``), no
file of hpctrain names a family's layers. Parallelism, planning, training and the pretrained
tools reach the model through its family's spec (``hpctrain.models.spec``), so a new family
needs no change there. Import-free: the source files are read as text."""

from __future__ import annotations

import re
from pathlib import Path

import hpctrain

SRC = Path(hpctrain.__file__).parent
FAMILY_DIR = SRC / "models" / "llama"
QWEN_DIR = SRC / "models" / "qwen"

# Llama's module names as code reaches them (attribute access, plan keys, state-dict names), its
# block classes, and its Hugging Face tensor names; prose words ("attention", "output") alone
# are not layer names.
LAYER_NAMES = re.compile("|".join((
    r"\btok_embeddings\b", r"\battention_norm\b", r"\bffn_norm\b", r"\bfeed_forward\b",
    r"\bTransformerBlock\b", r"\bFeedForward\b", r"\bTransformer\(",
    r"\bw[qvo123]\b", r"\.wk\b",
    r"(?<!args)\.layers\b", r"[\"']layers[.\"']", r"\blayers\.\{",
    r"\.attention\.", r"[\"']attention\.", r"\.output\.weight\b", r"[\"']output[.\"']",
    r"[\"']norm[\"']",
    r"\bembed_tokens\b", r"\b[qkvo]_proj\b", r"\b(gate|up|down)_proj\b", r"\blm_head\b",
    r"\bself_attn\b", r"\binput_layernorm\b", r"\bpost_attention_layernorm\b",
)))


# Qwen's own module names (its Hugging Face names are Llama's, above): the model's parts, its
# blocks' and their attention's and MLP's, as attribute access, plan keys or state-dict names.
QWEN_LAYER_NAMES = re.compile("|".join((
    r"\bQwenModel\b", r"\bfinal_norm\b", r"\battn_norm\b", r"\bmlp_norm\b", r"\b[qk]_norm\b",
    r"[\"']embed[.\"']", r"\.embed\b", r"[\"']head[.\"']", r"[\"']blocks\.", r"\bblocks\.\{",
    r"\battn\.[qkvo]\b", r"\bmlp\.(gate|up|down)\b",
)))


def layer_names_outside(src: Path, family_dir: Path,
                        names: re.Pattern[str] = LAYER_NAMES) -> list[str]:
    """``file:line: match`` for every layer name of ``names`` in ``src`` outside
    ``family_dir``."""
    hits = []
    for path in sorted(src.rglob("*.py")):
        if family_dir in path.parents:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for m in names.finditer(line):
                hits.append(f"{path.relative_to(src)}:{n}: {m.group(0)}")
    return hits


# Qwen's Hugging Face checkpoints name their tensors as Llama's do (``model.layers.N.self_attn.
# q_proj``): the Qwen family's own name table says those names, and none of Llama's own.
QWEN_HF_NAMES = "models/qwen/hf_names.py:"
HF_NAMES = re.compile("|".join((
    r"\.layers\b", r"\bembed_tokens\b", r"\b[qkvo]_proj\b", r"\b(gate|up|down)_proj\b",
    r"\blm_head\b", r"\bself_attn\b", r"\binput_layernorm\b",
    r"\bpost_attention_layernorm\b")))


# The vision models keep torchvision's parameter names (a torchvision state dict loads as is):
# its ViT encoder's blocks are ``encoder.layers.encoder_layer_N``, which the image task's FSDP
# units reach too. That ``.layers`` is torchvision's, not Llama's.
TORCHVISION_NAMES = ("models/vision/vit.py:", "tasks/images.py:")


def _allowed(hit: str) -> bool:
    where, name = hit.split(": ", 1)
    if hit.startswith(QWEN_HF_NAMES):
        return HF_NAMES.fullmatch(name) is not None
    return hit.startswith(TORCHVISION_NAMES) and name == ".layers"


def test_no_file_outside_the_family_folder_names_its_layers() -> None:
    hits = layer_names_outside(SRC, FAMILY_DIR)
    assert [h for h in hits if not _allowed(h)] == []


def test_no_file_outside_the_qwen_folder_names_its_layers() -> None:
    assert layer_names_outside(SRC, QWEN_DIR, QWEN_LAYER_NAMES) == []


def test_the_check_sees_layer_names(tmp_path: Path) -> None:
    """The pattern catches the ways code named the layers before the spec existed."""
    (tmp_path / "a.py").write_text(
        'for block in model.layers:\n    plan = {"attention.wq": 1, "feed_forward.w1": 2}\n'
        "emb = model.tok_embeddings\nnames = {'lm_head.weight': 'output.weight'}\n")
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "b.py").write_text("x = model.tok_embeddings\n")
    hits = layer_names_outside(tmp_path, tmp_path / "fam")
    assert [h.split(": ", 1)[1] for h in hits] == [
        ".layers", '"attention.', "wq", "feed_forward", "w1", "tok_embeddings", "lm_head",
        "'output."]
    (tmp_path / "c.py").write_text(
        'plan = {"attn.q": 1, "mlp.gate": 2, "final_norm": 3}\nw = model.embed.weight\n'
        "x = block.attn_norm(h)\nsd['head.weight'] = 0\nname = f'blocks.{i}.mlp.up'\n"
        "# prose: a head of attention, the embedding, an MLP's up projection\n")
    hits = layer_names_outside(tmp_path, tmp_path / "fam", QWEN_LAYER_NAMES)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "attn.q", "mlp.gate", "final_norm", ".embed", "attn_norm", "'head.", "'blocks.",
        "mlp.up"]
