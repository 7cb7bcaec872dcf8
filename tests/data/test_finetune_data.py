"""Fine-tuning data: chat and prompt-response examples become tokens plus a loss mask.

The mask must cover exactly the assistant's tokens (with the template's end-of-turn), be stored
beside each shard (manifest version 2, checked and verified), and reach the loss as
``IGNORE_INDEX`` targets for every prompt token, in training and validation batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import chat_tokenizer  # noqa: E402
from hpctrain.data.chat import ExampleFields  # noqa: E402
from hpctrain.data.loader import (  # noqa: E402
    IGNORE_INDEX,
    BatchLayout,
    GlobalOrderSampler,
    TokenLoader,
    ValidationSampler,
    validation_batches,
)
from hpctrain.data.mixing import MixedTokens  # noqa: E402
from hpctrain.data.prepare import PrepareSettings, prepare, prepare_task  # noqa: E402
from hpctrain.data.shard_dataset import ShardTokens  # noqa: E402
from hpctrain.data.shards import load_manifest  # noqa: E402
from hpctrain.data.staging import _dataset_files  # noqa: E402
from hpctrain.data.tokenizer import BYTE_EOS, HFTokenizer, TokenizerSpec  # noqa: E402
from hpctrain.errors import DataError  # noqa: E402

CHAT = {"messages": [{"role": "system", "content": "be brief."},
                     {"role": "user", "content": "what is two plus two?"},
                     {"role": "assistant", "content": "four."},
                     {"role": "user", "content": "and a colour?"},
                     {"role": "assistant", "content": "red."}]}


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _stream(out: Path) -> tuple[np.ndarray, np.ndarray]:
    m = load_manifest(out)
    return (np.concatenate([np.asarray(m.tokens(i)) for i in range(len(m.shards))]),
            np.concatenate([np.asarray(m.mask(i)) for i in range(len(m.shards))]))


def _settings(tokenizer: Path | None, fmt: str, shard_tokens: int = 1000) -> PrepareSettings:
    spec = TokenizerSpec() if tokenizer is None else TokenizerSpec("hf", str(tokenizer))
    return PrepareSettings(spec, shard_tokens=shard_tokens, format=fmt)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_tokenizer(tmp_path_factory.mktemp("tok"))


def test_chat_mask_is_the_assistant_turns_as_the_template_renders_them(tok_dir: Path,
                                                                       tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "chat.jsonl", [CHAT, CHAT])
    prepare([src], tmp_path / "out", _settings(tok_dir, "chat", shard_tokens=37))
    m = load_manifest(tmp_path / "out")
    assert m.raw["version"] == 2 and m.has_masks and len(m.shards) > 1  # masks cut with shards
    tokens, mask = _stream(tmp_path / "out")
    tok = HFTokenizer(str(tok_dir))
    decode = tok._tok.decode
    text = decode(tokens.tolist(), skip_special_tokens=False)
    one = ("<s><|system|>\nbe brief.<|end|>\n<|user|>\nwhat is two plus two?<|end|>\n"
           "<|assistant|>\nfour.<|end|>\n<|user|>\nand a colour?<|end|>\n<|assistant|>\n"
           "red.<|end|>\n</s>")
    assert text == one * 2  # each example one document, EOS after it
    kept = [decode([t], skip_special_tokens=False) for t in tokens[mask == 1][:len(mask) // 2]]
    assert "".join(kept[: len(kept) // 2]) == "four.<|end|>\nred.<|end|>\n"
    assert sum(s["loss_tokens"] for s in m.shards) == int(mask.sum())
    m.verify()
    assert {f for f in _dataset_files(tmp_path / "out") if f.endswith(".mask")} == {
        s["mask"] for s in m.shards}  # staging copies the masks too


def test_prompt_response_without_a_template_is_prompt_then_response_and_eos(
        tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "pr.jsonl", [{"prompt": "2+2=", "response": "4"},
                                         {"prompt": "hi", "response": "yo", "system": "s"}])
    prepare([src], tmp_path / "out", _settings(None, "prompt-response"))
    tokens, mask = _stream(tmp_path / "out")
    expected = [*b"2+2=", *b"4", BYTE_EOS, *b"s\nhi", *b"yo", BYTE_EOS]
    assert tokens.tolist() == expected
    assert mask.tolist() == [0] * 4 + [1, 1] + [0] * 4 + [1, 1, 1]


def test_prompt_response_with_a_template_is_a_two_turn_chat(tok_dir: Path,
                                                            tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "pr.jsonl", [{"q": "hello", "a": "fine thanks."}])
    settings = PrepareSettings(TokenizerSpec("hf", str(tok_dir)), shard_tokens=1000,
                               format="prompt-response",
                               fields=ExampleFields(prompt="q", response="a"))
    prepare([src], tmp_path / "out", settings)
    tokens, mask = _stream(tmp_path / "out")
    decode = HFTokenizer(str(tok_dir))._tok.decode
    assert decode(tokens.tolist(), skip_special_tokens=False) == (
        "<s><|user|>\nhello<|end|>\n<|assistant|>\nfine thanks.<|end|>\n</s>")
    assert decode(tokens[mask == 1].tolist(), skip_special_tokens=False) == (
        "fine thanks.<|end|>\n")


def test_plain_text_still_writes_version_1(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 20)
    prepare([tmp_path / "a.txt"], tmp_path / "out", _settings(None, "text"))
    raw = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert raw["version"] == 1 and "example_format" not in raw
    assert not any("mask" in s for s in raw["shards"])
    assert not load_manifest(tmp_path / "out").has_masks


def test_the_loader_ignores_every_prompt_target(tok_dir: Path, tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "chat.jsonl", [CHAT] * 12)
    prepare([src], tmp_path / "out", _settings(tok_dir, "chat", shard_tokens=200))
    m = load_manifest(tmp_path / "out")
    ds = ShardTokens(m, seq_len=16, val_fraction=0.25)
    assert ds.has_loss_mask
    layout = BatchLayout(micro_batch=len(ds), grad_accum=1, world_size=1, rank=0)
    loader = TokenLoader(ds, GlobalOrderSampler(len(ds), layout, seed=0), torch.device("cpu"),
                         prefetch=0)
    [(inputs, targets)] = loader.next_step()
    windows = np.stack([ds.window(i) for i in range(len(ds))]).astype(np.int64)
    masks = ds.mask_windows(np.arange(len(ds)))
    order = [int(np.flatnonzero((windows[:, :-1] == row).all(axis=1))[0])
             for row in inputs.numpy()]
    expected = np.where(masks[order, 1:], windows[order, 1:], IGNORE_INDEX)
    assert np.array_equal(targets.numpy(), expected)
    assert 0 < (targets != IGNORE_INDEX).sum() < targets.numel()
    val = ShardTokens(m, seq_len=16, split="val", val_fraction=0.25)
    sampler = ValidationSampler(len(val), world_size=1, rank=0, micro_batch=len(val))
    [(_, vt, _)] = list(validation_batches(val, sampler, torch.device("cpu")))
    vm = val.mask_windows(np.arange(len(val)))
    assert np.array_equal(vt.numpy() == IGNORE_INDEX, ~vm[:, 1:])


def test_a_mixture_masks_only_its_masked_sources(tok_dir: Path, tmp_path: Path) -> None:
    _jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    (tmp_path / "a.txt").write_text("plain text " * 40)
    prepare([tmp_path / "chat.jsonl"], tmp_path / "chat", _settings(tok_dir, "chat"))
    prepare([tmp_path / "a.txt"], tmp_path / "text", _settings(None, "text"))
    chat = ShardTokens(load_manifest(tmp_path / "chat"), seq_len=8)
    text = ShardTokens(load_manifest(tmp_path / "text"), seq_len=8)
    mix = MixedTokens([chat, text], [1.0, 1.0], weighted=False)
    assert mix.has_loss_mask
    masks = mix.mask_windows(np.arange(len(mix)))
    assert np.array_equal(masks[: len(chat)], chat.mask_windows(np.arange(len(chat))))
    assert masks[len(chat):].all()


@pytest.mark.parametrize("record, why", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "not text"),
    ({"text": "no messages"}, "no list 'messages'"),
])
def test_malformed_examples_are_refused_by_file_and_record(tmp_path: Path, record: dict,
                                                           why: str) -> None:
    src = _jsonl(tmp_path / "bad.jsonl", [CHAT, record])
    with pytest.raises(DataError) as e:
        prepare([src], tmp_path / "out", _settings(None, "chat"))
    assert why in e.value.what and "bad.jsonl, record 2" in e.value.what
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_template_that_rewrites_earlier_turns_is_refused(tok_dir: Path,
                                                           tmp_path: Path) -> None:
    """Reasoning models' templates drop earlier assistant turns: the mask cannot be found by
    rendering turn by turn, so the example is refused rather than masked wrongly."""
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last"
                            " %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    src = _jsonl(tmp_path / "chat.jsonl", [CHAT])
    with pytest.raises(DataError, match="turn by turn"):
        prepare([src], tmp_path / "out", _settings(folder, "chat"))


def test_array_mode_refuses_examples(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "chat.jsonl", [CHAT])
    with pytest.raises(DataError, match="array mode"):
        prepare_task([src], tmp_path / "out", _settings(None, "chat"), 0, 2)


def test_templates_may_use_loop_controls_as_transformers_allows() -> None:
    from hpctrain.data.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% break %}{% endfor %}",
                            {"eos_token": "</s>"})
    assert template.render([{"role": "user", "content": "a"},
                            {"role": "assistant", "content": "b"}], False) == "a"
