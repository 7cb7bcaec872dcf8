"""benchmarks/fp8_loss.py: repeats in ABBA order, the tail score, the verdict; and one real run
of each precision on CPU (a tiny model, float8 emulated)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import DEMO, TINY

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_loss.py"


@pytest.fixture(scope="module")
def fp8_loss():
    spec = importlib.util.spec_from_file_location("fp8_loss_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_runs_alternate_abba(fp8_loss) -> None:
    assert fp8_loss.order(3) == ["bf16", "fp8", "fp8", "bf16", "bf16", "fp8"]


def test_the_score_is_the_mean_of_the_last_windows(fp8_loss, tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    lines = [{"step": s, "loss": float(s), "tokens_per_s": 1.0} for s in (10, 20, 30, 40)]
    (tmp_path / "metrics" / "rank-000.jsonl").write_text(
        "\n".join(json.dumps(w) for w in [{"event": "layout"}, *lines]) + "\n")
    assert fp8_loss.tail_score(tmp_path, 20) == pytest.approx(35.0)  # windows ending at 30, 40
    assert fp8_loss.tail_score(tmp_path, 10) == pytest.approx(40.0)


@pytest.mark.parametrize(("scores", "within", "resolvable"), [
    ({"bf16": [2.00, 2.01], "fp8": [2.01, 2.02]}, True, True),     # gap +0.75%, spread 0.5%
    ({"bf16": [2.00, 2.01], "fp8": [2.05, 2.06]}, False, True),    # gap +2.2%
    ({"bf16": [2.00, 2.10], "fp8": [2.05, 2.05]}, True, False),    # spread 4.9%: can't resolve
    ({"bf16": [2.00], "fp8": [2.01]}, True, False),                # one run: no spread known
])
def test_the_verdict_weighs_the_gap_against_bf16s_own_spread(
        fp8_loss, scores: dict, within: bool, resolvable: bool) -> None:
    v = fp8_loss.verdict(scores, 0.01)
    assert (v.within, v.resolvable) == (within, resolvable)
    text = v.text()
    assert ("NOT within" in text) != within
    assert ("note:" in text) != resolvable


def test_one_run_of_each_on_cpu(fp8_loss, tmp_path: Path, capsys) -> None:
    out = tmp_path / "fp8"
    code = fp8_loss.main(["--config", DEMO, "--set", *TINY, "run.device=cpu",
                          "train.fp8_emulate=true", "--steps", "8", "--log-every", "2",
                          "--tail", "4", "--repeats", "1", "--timeout", "300",
                          "--out", str(out)])
    assert code == 0, capsys.readouterr()
    result = json.loads((out / "fp8_loss.json").read_text())
    assert [r["precision"] for r in result["runs"]] == ["bf16", "fp8"]
    assert all(r["score"] > 0 and r["tokens_per_s_per_gpu"] > 0 for r in result["runs"])
    assert result["bf16_spread"] is None and result["resolvable"] is False
    assert "verdict: fp8" in capsys.readouterr().out


def test_a_tail_longer_than_the_run_is_refused(fp8_loss, capsys) -> None:
    with pytest.raises(SystemExit):
        fp8_loss.main(["--steps", "20", "--tail", "50"])
    assert "--tail 50" in capsys.readouterr().err
