"""`hpctrain report`'s content, read from the HTML (the browser test checks it renders)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from synthetic_runs import write_run

from hpctrain.cli import main
from hpctrain.observe.report import detect_stragglers
from hpctrain.observe.rundata import load_run


def _report(tmp_path: Path, *runs: Path, out: Path | None = None) -> str:
    args = ["report", *map(str, runs)] + (["-o", str(out)] if out else [])
    main(args)
    return (out or runs[0] / "report.html").read_text()


def test_one_run_default_output_and_sections(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "r")
    html = _report(tmp_path, run)
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    for plot in ("loss", "tokens_per_s", "mfu", "memory", "lr", "grad_norm", "stragglers-0",
                 "goodput-0", "timeline-0"):
        assert f'data-plot="{plot}"' in html
    assert "rank 2 on host <b>node-b</b>" in html  # judged from own times (no live event)
    assert "goodput 63.3%" in html
    assert "preempted by SIGUSR2 at step 18" in html  # from the rank-0 log
    assert "rollback to step-00000010" in html and "resumed from step-00000020" in html
    assert "attempt 1: exit 75" in html
    assert "Config difference" not in html  # one run
    assert "http://" not in html.replace("http://www.w3.org", "")  # nothing to fetch


def test_profile_links_are_relative_to_the_report(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs" / "r")
    html = _report(tmp_path, run, out=tmp_path / "elsewhere" / "rep.html")
    hrefs = re.findall(r"href='([^']+)'", html)
    assert "../runs/r/profiles/step-000003-000004/rank-002.trace.json" in hrefs
    for href in hrefs:
        assert (tmp_path / "elsewhere" / href).is_file(), href


def test_live_straggler_events_are_used_when_recorded(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", slow_rank=None)
    with (run / "metrics" / "rank-000.jsonl").open("a") as f:
        f.write(json.dumps({"ts": 1.79e9 + 5, "rank": 0, "host": "node-a0",
                            "event": "straggler", "step": 7, "straggler_rank": 3,
                            "straggler_host": "gpu-z9", "slower_by": 0.4, "windows": 3}) + "\n")
    (event,) = detect_stragglers(load_run(run))
    assert event["straggler_host"] == "gpu-z9"
    assert "rank 3 on host <b>gpu-z9</b>" in _report(tmp_path, run)


def test_several_runs_overlay_and_show_the_config_difference(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", goodput=False, lr=3e-4, config_extra={"data": {"x": 1}})
    html = _report(tmp_path, a, b, out=tmp_path / "both.html")
    diff = html[html.index("Config difference"):]
    assert "<th>optim.lr</th><td>0.001</td><td>0.0003</td>" in diff
    assert "<th>data.x</th><td><i>absent</i></td><td>1</td>" in diff
    assert "optim.warmup_steps" not in diff  # equal in both
    assert "goodput not recorded (no goodput.json in this run)" in html


def test_hang_section_names_rank_host_and_collective(tmp_path: Path) -> None:
    run = write_run(tmp_path / "h", slow_rank=None, exit_code=124)
    info = json.loads((run / "exit_info.json").read_text())
    info["reason"] = "watchdog: rank 0 waited 5 s"
    info["extra"] = {"suspect_rank": 1, "suspect_host": "node-a1",
                     "heartbeat_steps": {"0": 7, "1": 6, "2": 7, "3": 7},
                     "collective": {"process_group": "1", "seq": 42, "op": "nccl:all_reduce",
                                    "joined": [0, 2, 3], "missing": [1], "no_dump": []}}
    (run / "exit_info.json").write_text(json.dumps(info))
    html = _report(tmp_path, run)
    assert "Hang forensics" in html
    assert "rank <b>1</b> on host <b>node-a1</b>" in html
    assert ("collective nccl:all_reduce #42 of process group 1 was entered by rank(s) 0, 2, 3 "
            "but not by rank(s) 1") in html


@pytest.mark.parametrize("make", ["missing", "empty", "file"])
def test_not_a_run_is_a_user_error(tmp_path: Path, make: str, capsys) -> None:
    path = tmp_path / "x"
    if make == "empty":
        path.mkdir()
    elif make == "file":
        path.write_text("hello")
    with pytest.raises(SystemExit) as done:
        main(["report", str(path)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"{path} is not a run directory" in err and "HINT" in err


def test_unwritable_output_is_a_user_error(tmp_path: Path, capsys) -> None:
    run = write_run(tmp_path / "r", ranks=2, steps=3)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as done:
        main(["report", str(run), "-o", str(blocker / "report.html")])
    assert done.value.code == 2 and "cannot write the report" in capsys.readouterr().err
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_a_damaged_run_still_reports(tmp_path: Path) -> None:
    """Cut lines, non-finite values and a missing config leave their parts empty, no crash."""
    run = write_run(tmp_path / "d", ranks=2, steps=4)
    with (run / "metrics" / "rank-000.jsonl").open("a") as f:
        f.write('{"ts": 1, "step": 5, "loss": "nan", "lr": "inf"}\n{"ts": 2, "step": 6, "lo')
    (run / "config" / "config.yaml").unlink()
    (run / "goodput.json").write_text("{not json")
    os.remove(run / "provenance" / "provenance.json")
    html = _report(tmp_path, run)
    assert "goodput not recorded" in html and "No provenance recorded" in html
