"""A preemption signal that arrives while `python -m hpctrain` is still importing is kept.

The child runs ``python -m hpctrain`` (through runpy, as ``-m`` does) with an import hook that
stops at the start of ``import torch``, the slow part of start-up: it writes a marker, then
waits until the signal has arrived. The test sends SIGUSR2 only after the marker, so the signal
lands during the import by construction, whatever the machine's speed, and the hook records
what start-up had caught by then.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run in the child: pause the first `import torch` until a signal was recorded, then go on.
CHILD = """\
import runpy, sys, time
from pathlib import Path

marker = Path(sys.argv.pop(1))


class PauseAtTorch:
    done = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self.done:
            return None
        self.done = True
        from hpctrain.runtime import early_signals  # installed by hpctrain/__main__.py
        marker.write_text("importing torch\\n")
        deadline = time.monotonic() + 120
        while not early_signals.received and time.monotonic() < deadline:
            time.sleep(0.01)
        marker.write_text(f"caught during import: {early_signals.received}\\n")
        return None  # the normal finders import torch


sys.meta_path.insert(0, PauseAtTorch())
sys.argv[0] = "hpctrain"
runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
"""


def test_signal_during_startup_still_checkpoints(tmp_path: Path) -> None:
    args = ["configs/demo.yaml", "run.device=cpu", "data.source=stdlib", "data.max_bytes=200000",
            "data.seq_len=32", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=128", "train.steps=50", "train.precision=fp32",
            "metrics.progress=false", "preempt.check_every=1", "checkpoint.interval=none",
            f"run.out_dir={tmp_path}", "run.name=early", "run.suffix=none"]
    marker = tmp_path / "import-marker"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), "train", *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the child never reached `import torch`"
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR2)  # the child is inside `import torch` now
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert marker.read_text() == "caught during import: ['SIGUSR2']\n", err[-2000:]
    assert proc.returncode == 75, err[-2000:]  # preempted, not killed by the signal
    info = json.loads((tmp_path / "early" / "exit_info.json").read_text())
    assert "preempted by SIGUSR2 at step 1" in info["reason"], info
    ckpt = tmp_path / "early" / "checkpoints" / info["last_checkpoint"]
    assert (ckpt / "manifest.json").is_file()
