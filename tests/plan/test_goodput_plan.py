"""``hpctrain plan goodput`` (Daly's expected goodput) and ``plan interval --from-run``: what a
save costs a run is read from its goodput ledgers (stall plus slowdown), not the stall alone.
The comparison with a CPU run under injected failures is in tests/train/test_goodput_runs.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.observe.goodput import GoodputClock
from hpctrain.plan.goodput import predict_goodput
from hpctrain.plan.interval import daly_interval


def test_daly_goodput_limits_and_a_worked_value() -> None:
    # No failures: only the checkpoints cost anything.
    p = predict_goodput(mttf_s=1e12, save_s=30, restart_s=600, interval_s=570)
    assert p.goodput == pytest.approx(570 / 600, rel=1e-6)
    assert p.checkpoint == pytest.approx(1 - p.goodput, rel=1e-3) and p.restart < 1e-6
    # Daly's expected wall time per unit of work, by hand: M e^(R/M) (e^((τ+δ)/M) - 1) / τ.
    m, delta, r, tau = 24 * 3600, 300, 600, 7000
    by_hand = tau / (m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1))
    p = predict_goodput(m, delta, r, tau)
    assert p.goodput == pytest.approx(by_hand)
    assert p.checkpoint + p.lost_work + p.restart == pytest.approx(1 - p.goodput)
    # Default interval: Daly's optimum, which beats intervals on either side of it.
    best = predict_goodput(m, delta, r)
    assert best.interval_s == pytest.approx(daly_interval(delta, m))
    assert best.goodput > predict_goodput(m, delta, r, best.interval_s / 2).goodput
    assert best.goodput > predict_goodput(m, delta, r, best.interval_s * 2).goodput


def _run_with_saves(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger: steps of 1 s, two saves that each stall 1 s and slow the next step by 3 s."""
    now = [1000.0]
    monkeypatch.setattr("hpctrain.observe.goodput.time.time", lambda: now[0])
    c = GoodputClock(run_dir / "goodput" / "attempt-0001.json", start=now[0])
    (run_dir / "goodput").mkdir(parents=True)
    now[0] += 60
    c.started(None)
    for step in range(1, 9):
        now[0] += 4.0 if step in (4, 7) else 1.0  # the steps right after a save
        c.step_done(step, writing=step in (4, 7))
        c.window_closed()
        if step in (3, 6):
            with c.part("checkpoint"):
                now[0] += 1.0
            c.saved(step, background=True)
    c.finish(0)


def test_cli_goodput_and_interval_from_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    _run_with_saves(tmp_path / "run", monkeypatch)
    main(["plan", "interval", "--from-run", str(tmp_path / "run"), "--mttf-h", "24"])
    out = capsys.readouterr().out
    assert "checkpoint save 4 s (measured" in out  # 1 s stall + 3 s slowdown, per save
    m = 24 * 3600
    assert f"Daly:  checkpoint every {daly_interval(4.0, m) / 60:.1f} min" in out
    main(["plan", "goodput", "--from-run", str(tmp_path / "run"), "--mttf-h", "24",
          "--interval-min", "60"])
    out = capsys.readouterr().out
    expected = predict_goodput(m, 4.0, 60.0, 3600).goodput  # restart: the 60 s start-up
    assert f"expected goodput {expected:.1%}" in out and "save 4 s, restart 60 s" in out
    main(["plan", "goodput", "checkpoint.mttf_gpu_hours=50000", "--gpus", "1024", "--save-s", "20",
          "--restart-s", "300"])
    assert "(Daly's optimum)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "goodput", "--mttf-h", "24", "--restart-s", "60"], "no --save-s"),
    (["plan", "goodput", "--mttf-h", "24", "--save-s", "5", "--from-run", "/nonexistent"],
     "no measured restart_cost"),
    (["plan", "interval", "--mttf-h", "24"], "no --save-min"),
])
def test_cli_goodput_errors_exit_2(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
