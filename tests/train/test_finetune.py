"""The fine-tuning recipe end to end on the CPU: import -> prepare chat data -> fine-tune ->
eval -> export -> generate, on a tiny Llama made by transformers (nothing downloaded).

Two runs of ``configs/finetune-llama.yaml`` start side by side, one from the Hugging Face folder
(``init_from: hf:DIR``, read box by box) and one from ``hpctrain import hf``'s checkpoint (DCP):
the same weights, so the same losses. The first step's loss is the one computed here from the
same first batch with the prompt targets left out, so the loss counts the responses only; the
response loss on held-out examples falls; the exported model gives transformers the logits
hpctrain computes.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import REPO, RunResult, run_cli  # noqa: E402
from hf_models import chat_tokenizer, hf_logits, hf_model  # noqa: E402
from hpctrain.cli import main  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.data.chat import chat_prompt  # noqa: E402
from hpctrain.data.loader import (  # noqa: E402
    IGNORE_INDEX,
    BatchLayout,
    GlobalOrderSampler,
    TokenLoader,
    build_dataset,
)
from hpctrain.models.generate import generate  # noqa: E402
from hpctrain.models.init_source import InitSource  # noqa: E402
from hpctrain.pretrained.source import model_tokenizer, resolve_source  # noqa: E402
from hpctrain.pretrained.weights import load_model  # noqa: E402

RECIPE = "configs/finetune-llama.yaml"
STEPS = 20
MICRO, SEQ = 8, 64


def _overrides(out: Path, name: str, init_from: str, data: Path) -> list[str]:
    return [f"model.init_from={init_from}", f"model.max_seq_len={SEQ}", f"data.path={data}",
            "data.source=shards", f"data.seq_len={SEQ}", "data.val_fraction=0.1",
            f"train.steps={STEPS}", f"train.micro_batch={MICRO}", "train.precision=fp32",
            "train.deterministic=true",
            "train.val_every=0", "optim.lr=3e-3", "optim.warmup_steps=2",
            "parallel.strategy=none", "run.device=cpu", "metrics.log_every=1",
            "metrics.progress=false", "checkpoint.interval=none", "checkpoint.every=null",
            "run.suffix=none",
            f"run.out_dir={out}", f"run.name={name}"]


def _cli_out(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(argv)
    return buf.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, run_pool) -> dict:
    root = tmp_path_factory.mktemp("finetune")
    folder = hf_model(root / "tiny-llama", "llama_tied", randomize=False)
    chat_tokenizer(folder)
    rng = random.Random(0)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(400):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"what is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a + b}."}]}) + "\n")
    data = root / "data"
    main(["data", "prepare", str(root / "chat.jsonl"), "--format", "chat", "--tokenizer",
          str(folder), "--out", str(data), "--workers", "1", "--no-progress"])
    main(["import", "hf", str(folder), "--out", str(root / "ckpt")])
    runs = root / "runs"
    jobs = {name: run_pool.submit(_train, runs, name, init, data)
            for name, init in (("from_hf", f"hf:{folder}"), ("from_ckpt", str(root / "ckpt")))}
    return {"root": root, "folder": folder, "data": data, "runs": runs,
            **{name: job.result() for name, job in jobs.items()}}


def _train(runs: Path, name: str, init_from: str, data: Path) -> RunResult:
    args = ["train", RECIPE, *_overrides(runs, name, init_from, data)]
    done = run_cli(args)
    return RunResult(args, done.returncode, done.stdout, done.stderr, runs / name).ok()


def _losses(run: RunResult) -> list[float]:
    return [r["loss"] for r in run.metrics() if "loss" in r]  # validation records left out


def test_both_starting_points_are_the_same_model(setup) -> None:
    hf, ckpt = _losses(setup["from_hf"]), _losses(setup["from_ckpt"])
    assert len(hf) == STEPS
    assert hf == pytest.approx(ckpt, rel=1e-6)


def test_the_loss_counts_the_responses_only(setup) -> None:
    cfg = load_config(REPO / RECIPE, _overrides(setup["runs"], "x", f"hf:{setup['folder']}",
                                                setup["data"]))
    dataset = build_dataset(cfg.data, vocab_size=cfg.model.resolve().vocab_size)
    layout = BatchLayout(MICRO, 1, 1, 0)
    loader = TokenLoader(dataset, GlobalOrderSampler(len(dataset), layout, cfg.run.seed,
                                                     remainder=cfg.data.remainder),
                         torch.device("cpu"), prefetch=0)
    [(inputs, targets)] = loader.next_step()
    counted = targets != IGNORE_INDEX
    assert 0 < counted.sum() < targets.numel() / 4  # the prompts are most of the tokens
    model = load_model(InitSource("hf", setup["folder"]))
    with torch.no_grad():
        summed = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum")
    # The mean over the response tokens alone: the prompt share of a batch must not dilute it.
    expected = summed.item() / counted.sum().item()
    assert _losses(setup["from_hf"])[0] == pytest.approx(expected, rel=1e-5)


def test_fine_tuning_lowers_the_held_out_response_loss(setup) -> None:
    run = setup["runs"] / "from_hf"
    after = json.loads(_cli_out(["eval", str(run), "--json"]))
    before = json.loads(_cli_out(["eval", f"hf:{setup['folder']}", "--data",
                                  str(setup["data"]), "--val-fraction", "0.1", "--seq-len",
                                  str(SEQ), "--json"]))
    assert after["tokens"] == before["tokens"] > 0
    assert after["loss"] < before["loss"] - 1.5, (before, after)


def test_the_fine_tuned_run_exports_and_samples(setup) -> None:
    from transformers import AutoModelForCausalLM

    run, out = setup["runs"] / "from_ckpt", setup["root"] / "exported"
    main(["export", "hf", str(run), "--out", str(out), "--dtype", "fp32"])
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = load_model(InitSource("checkpoint", run / "checkpoints" / f"step-{STEPS:08d}"))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, tokens), ours(tokens), rtol=0, atol=1e-5)
    # Greedy replies: the CLI's, hpctrain's and transformers' (on the export) agree.
    tok = model_tokenizer(resolve_source(str(run)))
    prompt = chat_prompt(tok.tokenizer, tok.template, "what is 2 plus 3?")
    ids = generate(ours, prompt, 6)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert ids == expected
    stopped = generate(ours, prompt, 6, stop_ids=tok.stop_ids)
    text = _cli_out(["generate", str(run), "--chat", "--prompt", "what is 2 plus 3?",
                     "--max-new-tokens", "6"])
    assert text == tok.tokenizer.decode(stopped) + "\n"
