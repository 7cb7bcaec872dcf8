"""`hpctrain report` opened in a real headless browser: Debian's chromium through chromedriver.

scripts/install-browser.sh installs both (``make test`` runs it). Without them the test skips,
saying why; under CI=true it fails instead, so CI never goes green without having run it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
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
