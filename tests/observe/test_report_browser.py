"""`hpctrain report` opened in a real headless browser: Debian's chromium through chromedriver.

scripts/install-browser.sh installs both (``make test`` runs it). Without them the test skips,
saying why; under CI=true it fails instead, so CI never goes green without having run it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from synthetic_runs import write_run

from hpctrain.cli import main

CHROMIUM = os.environ.get("HPCTRAIN_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("HPCTRAIN_CHROMEDRIVER", "/usr/bin/chromedriver")
# Flags Chromium needs on these machines: no sandbox as root, no GPU, and no background
# connections (refused by the closed network, many at a time).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000")
PLOTS = ("loss", "tokens_per_s", "mfu", "memory", "lr", "grad_norm", "stragglers-0",
         "goodput-0", "timeline-0", "stragglers-1", "goodput-1", "timeline-1")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        why = (f"{' and '.join(missing)} not installed: run scripts/install-browser.sh "
               "(as root; `make test` does)")
        if _in_ci():
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium must not phone home
    profile = tempfile.mkdtemp(prefix="hpctrain-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_report_loads_without_errors_shows_every_plot_and_names_the_straggler(
        browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    a = write_run(tmp_path / "run-a", slow_rank=2, slow_host="node-b")
    b = write_run(tmp_path / "run-b", slow_rank=None, goodput=False, lr=3e-4, exit_code=124)
    out = tmp_path / "out" / "report.html"
    main(["report", str(a), str(b), "-o", str(out)])

    browser.get(out.as_uri())
    assert browser.execute_script("return document.documentElement.dataset.ready") == "1"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    for plot in PLOTS:
        (figure,) = browser.find_elements(By.CSS_SELECTOR, f'figure[data-plot="{plot}"]')
        chart = figure.find_element(By.CSS_SELECTOR, "svg")
        assert chart.size["width"] > 100 and chart.size["height"] > 20, plot
        drawn = chart.find_elements(By.CSS_SELECTOR, "path, rect, text")
        assert drawn, f"plot {plot} draws nothing"
    for plot in ("loss", "tokens_per_s", "mfu", "memory", "lr", "grad_norm"):
        paths = browser.find_elements(By.CSS_SELECTOR, f'figure[data-plot="{plot}"] svg path')
        assert len(paths) >= 2, f"{plot}: both runs overlaid"

    names = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".straggler-name")]
    assert len(names) == 1 and "rank 2 on host node-b" in names[0], names
    marked = browser.find_elements(By.CSS_SELECTOR,
                                   'figure[data-plot="stragglers-0"] text.straggler')
    assert [m.text for m in marked] == ["rank 2 node-b"]
    assert "goodput not recorded" in browser.find_element(
        By.CSS_SELECTOR, 'figure[data-plot="goodput-1"]').text
    assert "productive" in browser.find_element(
        By.CSS_SELECTOR, 'figure[data-plot="goodput-0"]').text
    diff = browser.find_element(By.CSS_SELECTOR, ".config-diff").text
    assert "optim.lr" in diff and "0.0003" in diff

    # The hover read-out: the inline script answers the pointer.
    loss = browser.find_element(By.CSS_SELECTOR, 'figure[data-plot="loss"] svg')
    ActionChains(browser).move_to_element(loss).perform()
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed() and "run-a: step" in tip.text


# -- hostile run text ------------------------------------------------------------------------

# Markup that, unescaped, would navigate (meta refresh), run script (img onerror, svg onload,
# script), end the title early or break out of a quoted attribute. The file-name variant has no
# "/" (a file name cannot hold one).
MARKUP = ('"\'><meta http-equiv="refresh" content="0;url=about:blank#pwned"></title>'
          '<img src=x onerror="document.title=\'pwned\'"><svg onload="document.title=\'pwned\'">'
          '<script>document.title="pwned"</script><b class="injected">bold</b>')
FILE_MARKUP = ("'\"><meta http-equiv=refresh content=0;url=about:blank#pwned>"
               "<img src=x onerror=alert(1)><svg onload=alert(1)><b class=injected>b<b>")


def _planted_run(parent: Path, text: str, file_text: str) -> Path:
    """A run whose every string field, of every metrics event kind the training writes (train
    records, layout, observe, checkpoint, checkpoint_stall, checkpoint_writer, checkpoint_load,
    rollback, bad_steps, goodput, profile, straggler, straggler_recovered), of the preemption
    log line, exit info, goodput.json, provenance and config, is ``text``; and whose file names
    (the run folder, profile traces and snapshots, out-of-memory snapshots) hold ``file_text``."""
    root = parent / f"run{file_text}"
    (root / "config").mkdir(parents=True)
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(
        {"run": {"name": text}, "optim": {"lr": text}, "data": {"path": text},
         "metrics": {"straggler_threshold": 0.1, "straggler_windows": 2}}))
    (root / "provenance").mkdir()
    (root / "provenance" / "provenance.json").write_text(json.dumps(
        {k: text for k in ("git_sha", "git_dirty", "hpctrain", "torch", "cuda", "nccl",
                           "python", "platform")} | {"gpus": [text], "hosts": [text],
                                                     "argv": [text, text]}))
    trace, snapshot = f"profiles/trace-{file_text}.json", f"profiles/mem-{file_text}.pickle"
    (root / "profiles").mkdir()
    for name in (trace, snapshot, f"profiles/oom-rank-{file_text}.pickle"):
        (root / name).write_bytes(b"x")
    for rank in (0, 1):
        def at(ts: float, **fields) -> dict:
            return {"ts": 100.0 + ts, "rank": rank, "host": text, **fields}  # noqa: B023
        lines = [at(0, event="layout", pp=1, dp_replicate=1, dp_shard=2, tp=1,
                    coords={"dp_shard": rank}, tokens_per_step_per_gpu=64,
                    mfu_peak_dtype=text),
                 at(0, event="observe", pid=1, own_time=text, profile_signal=text),
                 at(0.5, event="checkpoint_writer", step=0, writer=text, staged_bytes=1,
                    prepare_s=0.1),
                 at(0.6, event="checkpoint_load", checkpoint=text, step=0, load_s=0.1)]
        for step in range(1, 7):
            lines.append(at(step, step=step, loss=2.0, lr=1e-3, grad_norm=1.0,
                            tokens_per_s=10.0, step_time_s=1.0, data_time_s=0.0, mem_gb=1.0,
                            own_time_s=0.1 + 0.8 * rank))
        lines += [at(2.5, event="checkpoint", step=2, bytes=10, write_s=0.1, gb_per_s=1.0,
                     writer=text, path=text),
                  at(2.6, event="checkpoint_stall", step=2, stall_s=0.1, wait_s=0.0,
                     **{"async": True}),
                  at(3.5, event="rollback", step=3, from_step=2, checkpoint=text, bad_streak=2),
                  at(3.6, event="bad_steps", step=3, skipped=1),
                  at(4.5, event="profile", first_step=3, last_step=4, trigger=text,
                     trace=trace, memory_snapshot=snapshot),
                  at(5.5, event="straggler", step=5, straggler_rank=1, straggler_host=text,
                     slower_by=0.5, windows=2),
                  at(5.6, event="straggler_recovered", step=6, straggler_rank=1,
                     straggler_host=text),
                  at(6.5, event="goodput", wall_s=10.0, goodput=0.5, note=text)]
        (root / "metrics").mkdir(exist_ok=True)
        (root / "metrics" / f"rank-{rank:03d}.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines))
    (root / "logs").mkdir()
    (root / "logs" / "rank-000.log").write_text(
        f"2026-01-01 00:00:00,000 [rank 0/2 h] WARNING hpctrain.train: preemption ({text}): "
        "checkpointing at step 3 and stopping\n")
    (root / "exit_info.json").write_text(json.dumps(
        {"exit_code": 124, "reason": text, "timestamp": 110.0,
         "extra": {"suspect_rank": text, "suspect_host": text, "heartbeat_steps": {"0": text},
                   "collective": {"process_group": text, "seq": 1, "op": text,
                                  "joined": [0], "missing": [1]}}}))
    (root / "goodput.json").write_text(json.dumps(
        {"version": 1, "wall_s": 10.0, "parts": {"startup": 1.0}, "goodput": 0.5,
         "attempts": [{"attempt": text, "start": 100.0, "end": 109.0, "exit_code": text,
                       "resumed_from_step": text, "last_step": text}]}))
    return root


_PAGE_FACTS = """
const all = [...document.querySelectorAll('*')];
const tags = {};
all.forEach(e => { tags[e.tagName] = (tags[e.tagName] || 0) + 1; });
return {tags: tags, title: document.title, url: location.href,
        handlers: all.filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length,
        injected: document.querySelectorAll('.injected').length,
        text: document.body.textContent};
"""


def test_run_text_never_becomes_an_element(browser, tmp_path: Path) -> None:
    """Markup planted in every string the report reads and every file name it lists is shown
    as text: the page holds exactly the elements of the same report of a plain run, one
    script (ours), no image, its own two meta elements, and it never navigated."""
    facts = {}
    for kind, text, file_text in (("plain", "plain text", "-plain"),
                                  ("hostile", MARKUP, FILE_MARKUP)):
        run = _planted_run(tmp_path / kind, text, file_text)
        out = tmp_path / kind / "report.html"
        main(["report", str(run), "-o", str(out)])
        browser.get(out.as_uri())
        assert browser.execute_script("return document.documentElement.dataset.ready") == "1"
        facts[kind] = browser.execute_script(_PAGE_FACTS)
        assert facts[kind]["url"] == out.as_uri(), facts[kind]["url"]  # no meta refresh
    hostile = facts["hostile"]
    assert hostile["tags"] == facts["plain"]["tags"]
    assert hostile["tags"]["META"] == 2 and hostile["tags"]["SCRIPT"] == 1
    assert "IMG" not in hostile["tags"]
    assert hostile["handlers"] == 0 and hostile["injected"] == 0
    # The title is the run folder's name as text (a script would have replaced it).
    assert hostile["title"] == f"hpctrain report: run{FILE_MARKUP}", hostile["title"]
    # Shown as text, where the plain run shows its text.
    assert hostile["text"].count('http-equiv="refresh"') >= 10
    assert "oom-rank-'\">" in hostile["text"]
