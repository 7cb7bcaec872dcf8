"""A preemption signal that arrives while `python -m hpctrain` is still importing is kept."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_signal_during_startup_still_checkpoints(tmp_path: Path) -> None:
    args = ["configs/demo.yaml", "run.device=cpu", "data.source=stdlib", "data.max_bytes=200000",
            "data.seq_len=32", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=128", "train.steps=50", "train.precision=fp32",
            "metrics.progress=false", "preempt.check_every=1", "checkpoint.interval=none",
            f"run.out_dir={tmp_path}", "run.name=early", "run.suffix=none"]
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # still importing torch: no trainer handler exists yet
    proc.send_signal(signal.SIGUSR2)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]  # preempted, not killed by the signal
    info = json.loads((tmp_path / "early" / "exit_info.json").read_text())
    assert "preempted by SIGUSR2 at step 1" in info["reason"], info
    ckpt = tmp_path / "early" / "checkpoints" / info["last_checkpoint"]
    assert (ckpt / "manifest.json").is_file()
