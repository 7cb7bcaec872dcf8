"""A run directory is data another user (or a compromised job) wrote: `hpctrain report` must
not turn its text into markup or script, and its page runs only its own script (CSP hash)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import yaml

from hpctrain.cli import main

PAYLOAD = '</script><script>alert(1)</script><img src=x onerror=alert(2)>'


def _hostile_run(root: Path) -> Path:
    (root / "config").mkdir(parents=True)
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(
        {"run": {"name": PAYLOAD}, "optim": {"lr": PAYLOAD}, "metrics": {}}))
    (root / "provenance").mkdir()
    (root / "provenance" / "provenance.json").write_text(json.dumps(
        {"git_sha": PAYLOAD, "hosts": [PAYLOAD], "argv": [PAYLOAD]}))
    for rank in (0, 1):
        lines = [{"ts": 1.0, "rank": rank, "host": PAYLOAD, "event": "layout"}]
        for step in range(1, 5):
            lines.append({"ts": 1.0 + step, "rank": rank, "host": PAYLOAD, "step": step,
                          "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
                          "step_time_s": 1.0, "data_time_s": 0.0, "mem_gb": 1.0,
                          "own_time_s": 0.1 + 0.8 * rank})
        lines.append({"ts": 9.0, "rank": rank, "host": PAYLOAD, "event": "profile",
                      "first_step": 1, "last_step": 2, "trigger": PAYLOAD,
                      "trace": "javascript:alert(3)", "memory_snapshot": PAYLOAD})
        lines.append({"ts": 9.5, "rank": 0, "host": PAYLOAD, "event": "straggler", "step": 3,
                      "straggler_rank": 1, "straggler_host": PAYLOAD, "slower_by": 0.5,
                      "windows": 3})
        (root / "metrics").mkdir(exist_ok=True)
        (root / "metrics" / f"rank-{rank:03d}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines))
    (root / "logs").mkdir()
    (root / "logs" / "rank-000.log").write_text(
        f"2026-01-01 00:00:00,000 [rank 0/2 h] WARNING hpctrain.train: preemption ({PAYLOAD}): "
        "checkpointing at step 3 and stopping\n")
    (root / "exit_info.json").write_text(json.dumps(
        {"exit_code": 124, "reason": PAYLOAD, "timestamp": 10.0,
         "extra": {"suspect_rank": PAYLOAD, "suspect_host": PAYLOAD,
                   "heartbeat_steps": {"0": PAYLOAD, PAYLOAD: 1},
                   "collective": {"process_group": PAYLOAD, "seq": 1, "op": PAYLOAD,
                                  "joined": [0], "missing": [1]}}}))
    (root / "goodput.json").write_text(json.dumps(
        {"version": 1, "wall_s": 10.0, "parts": {"startup": 1.0}, "goodput": 0.5,
         "attempts": [{"attempt": PAYLOAD, "start": 1.0, "end": 9.0, "exit_code": PAYLOAD}]}))
    return root


def test_run_text_never_becomes_markup_or_script(tmp_path: Path) -> None:
    run = _hostile_run(tmp_path / "<b>run</b>")
    out = tmp_path / "report.html"
    main(["report", str(run), str(run), "-o", str(out)])
    html = out.read_text()
    assert PAYLOAD not in html
    assert "<img" not in html and "<b>run</b>" not in html
    assert html.count("<script") == 1  # ours
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in html  # shown as text
    hrefs = re.findall(r"href='([^']*)'", html)
    assert hrefs and all(h.startswith(("./", "../")) for h in hrefs), hrefs

    # The page allows exactly its own script, by hash: an injected one could not run.
    (policy,) = re.findall(r'content="(default-src[^"]*)"', html)
    script = html[html.index("<script>") + len("<script>"):html.index("</script>")]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy and "unsafe-inline'" not in policy.split(
        "script-src")[1]
    assert "default-src 'none'" in policy
