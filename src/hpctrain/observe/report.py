"""``hpctrain report RUN [RUN...]``: one self-contained HTML file about one or several runs.

    hpctrain report runs/llama-1234                 # writes runs/llama-1234/report.html
    hpctrain report runs/a runs/b -o compare.html   # overlaid curves + the config difference

The page needs no network: charts are inline SVG, the only script (a hover read-out) is inline.
It shows loss and validation loss, tokens/s, MFU, memory, learning rate and gradient norm over
steps; a per-rank heatmap of each rank's own time per step that names stragglers (rank and
host); the goodput breakdown of ``goodput.json`` as a waterfall; a timeline of attempts,
checkpoints, restarts, rollbacks, bad steps, preemptions and the end; hang forensics (the
watchdog's heartbeats and the collective some ranks did not join); links to profiles and memory
snapshots; config and provenance, and with several runs the config keys that differ.
"""

from __future__ import annotations

import base64
import hashlib
import os
import statistics
from pathlib import Path
from typing import Any

from hpctrain.observe import svg
from hpctrain.observe.markup import esc
from hpctrain.observe.rundata import GOODPUT_PARTS, RunData, flatten, recorded_tokens_per_s
from hpctrain.observe.stragglers import RankTimes, StragglerDetector
from hpctrain.runtime.exit_codes import HUNG, PREEMPTED
from hpctrain.runtime.safe_open import write_atomic
from hpctrain.runtime.watchdog import describe_collective

# The charts every report has, in order: (data-plot id, title, metric key, y label).
CURVES = (
    ("tokens_per_s", "Throughput", "tokens_per_s", "tokens/s per rank"),
    ("mfu", "Model FLOPs utilisation", "mfu", "MFU"),
    ("memory", "Memory", "mem_gb", "GB (peak allocated on GPU, peak RSS on CPU)"),
    ("lr", "Learning rate", "lr", "learning rate"),
    ("grad_norm", "Gradient norm", "grad_norm", "global grad norm (before clipping)"),
)
# Heatmap columns at most (windows are averaged into bins beyond that).
MAX_COLUMNS = 150


def default_output(runs: list[Path]) -> Path:
    """``RUN/report.html`` for one run, ``report.html`` here for several."""
    return runs[0] / "report.html" if len(runs) == 1 else Path("report.html")


def run_state(run: RunData) -> str:
    """running, done, preempted, hung, interrupted, failed, or unknown (no exit info)."""
    if run.lock_alive():
        return "running"
    info = run.exit_info
    if info is None:
        return "unknown"
    code = info.get("exit_code")
    return {0: "done", PREEMPTED: "preempted", HUNG: "hung", 130: "interrupted"}.get(
        code, "failed")


def build_report(runs: list[RunData], out: Path) -> str:
    """The report's HTML text for ``runs`` (links made relative to ``out``'s folder)."""
    colours = {run.name: svg.PALETTE[i % len(svg.PALETTE)] for i, run in enumerate(runs)}
    title = "hpctrain report: " + ", ".join(run.name for run in runs)
    body = [f"<h1>{esc(title)}</h1>", _summary(runs)]
    body.append("<h2>Training</h2><div class='grid'>")
    body.append(_figure("loss", "Loss (dashed: validation)", _loss_chart(runs, colours)))
    for plot_id, name, key, y_label in CURVES:
        body.append(_figure(plot_id, name, _curve(runs, colours, key, y_label)))
    body.append("</div>")
    for i, run in enumerate(runs):
        body.append(f"<h2 id='run-{i}'>Run {esc(run.name)}</h2>")
        body.append(_stragglers(run, i))
        body.append(_goodput(run, i))
        body.append(_figure(f"timeline-{i}", "Timeline", _timeline(run)))
        body.append(_hang(run))
        body.append(_profiles(run, out))
        body.append(_provenance(run))
    if len(runs) > 1:
        body.append(_config_diff(runs))
    for run in runs:
        body.append(f"<details><summary>Config of {esc(run.name)}</summary><pre>"
                    f"{esc(_yaml(run.config))}</pre></details>")
    # Only this script may run: a run's text that slipped past escaping could not execute.
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    return _PAGE.format(title=esc(title), style=_STYLE, body="\n".join(body), script=_SCRIPT,
                        script_hash=f"sha256-{digest}")


def write_report(runs: list[RunData], out: Path) -> Path:
    """Write the report to ``out`` atomically; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Never through a link planted at the name or a temp name in the run directory.
    write_atomic(out, build_report(runs, out).encode("utf-8"))
    return out


# -- sections ----------------------------------------------------------------------------------

def _figure(plot_id: str, title: str, content: str) -> str:
    return (f'<figure class="plot" data-plot="{esc(plot_id)}">'
            f"<figcaption>{esc(title)}</figcaption>{content}</figure>")


def _summary(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        train = run.train_records()
        last = train[-1] if train else {}
        rate = recorded_tokens_per_s(run)  # the run's own number, as `done:` and `runs` show
        goodput = (run.goodput or {}).get("goodput")
        info = run.exit_info or {}
        rows.append(
            f"<tr><td>{esc(run.name)}</td><td class='state-{run_state(run)}'>"
            f"{run_state(run)}</td><td>{esc(last.get('step', ''))}</td>"
            f"<td>{esc(svg.fmt(last['loss'])) if 'loss' in last else ''}</td>"
            f"<td>{esc(svg.fmt(rate)) if rate is not None else 'not recorded'}</td>"
            f"<td>{f'{100 * goodput:.1f}%' if isinstance(goodput, int | float) else 'not recorded'}"
            f"</td><td>{len(run.ranks)}</td><td>{esc(info.get('reason', ''))}</td></tr>")
    return ("<table class='summary'><tr><th>run</th><th>state</th><th>step</th><th>loss</th>"
            "<th>tokens/s per rank</th><th>goodput</th><th>ranks</th><th>exit</th></tr>"
            + "".join(rows) + "</table>")


def _loss_chart(runs: list[RunData], colours: dict[str, str]) -> str:
    series, dashed = [], []
    for run in runs:
        c = colours[run.name]
        series.append((run.name, [(r["step"], r["loss"]) for r in run.train_records()], c))
        val = [(r["step"], r["val_loss"]) for r in run.val_records()]
        if val:
            label = f"{run.name} (validation)"
            series.append((label, val, c))
            dashed.append(label)
    return svg.line_chart(series, x_label="step", y_label="loss", dashed=dashed)


def _curve(runs: list[RunData], colours: dict[str, str], key: str, y_label: str) -> str:
    series = []
    for run in runs:
        pts = [(r["step"], r[key]) for r in run.train_records()
               if isinstance(r.get(key), int | float)]
        series.append((run.name, pts, colours[run.name]))
        if key == "mem_gb" and len(run.ranks) > 1:
            peak: dict[int, float] = {}
            for rank in run.ranks:
                for r in run.train_records(rank):
                    if isinstance(r.get(key), int | float):
                        peak[r["step"]] = max(peak.get(r["step"], 0.0), r[key])
            series.append((f"{run.name} (max over ranks)", sorted(peak.items()),
                           colours[run.name]))
    if key == "mfu" and not any(pts for _, pts, _ in series):
        return svg.empty_chart("MFU not recorded: the device's peak is unknown "
                               "(set metrics.peak_tflops to report it)")
    dashed = [label for label, _, _ in series if label.endswith("(max over ranks)")]
    return svg.line_chart(series, x_label="step", y_label=y_label, dashed=dashed)


def rank_times(run: RunData) -> tuple[list[int], list[float], list[list[float | None]], str]:
    """(ranks, window steps, seconds per step [rank][window], what was measured)."""
    ranks = sorted(run.ranks)
    key = "own_time_s"
    if not any("own_time_s" in r for r in run.train_records(ranks[0] if ranks else 0)):
        key = "step_time_s"
    per_rank = {rank: {r["step"]: r.get(key) for r in run.train_records(rank)} for rank in ranks}
    steps = sorted({s for values in per_rank.values() for s in values})
    values = [[per_rank[rank].get(s) for s in steps] for rank in ranks]
    return ranks, steps, values, key


def detect_stragglers(run: RunData) -> list[dict[str, Any]]:
    """Straggler events: the run's own (live), else judged here from the per-rank timings."""
    live = run.events("straggler")
    if live:
        return live
    ranks, steps, values, key = rank_times(run)
    if key != "own_time_s" or len(ranks) < 2:
        return []
    metrics = (run.config or {}).get("metrics") or {}
    hosts = run.hosts()
    detector = StragglerDetector([hosts.get(r, "?") for r in range(max(ranks) + 1)],
                                 float(metrics.get("straggler_threshold", 0.1)),
                                 int(metrics.get("straggler_windows", 3)) or 3, quiet=True)
    step_times = {rank: {r["step"]: r.get("step_time_s") for r in run.train_records(rank)}
                  for rank in ranks}
    found = []
    for c, step in enumerate(steps):
        if any(values[i][c] is None for i in range(len(ranks))):
            continue
        times = [RankTimes(own=values[i][c], step=step_times[rank].get(step) or 0.0)
                 for i, rank in enumerate(ranks)]
        found += [e for e in detector.update(step, times) if e["event"] == "straggler"]
    return found


def _binned(steps: list[float], values: list[list[float | None]]
            ) -> tuple[list[float], list[list[float | None]]]:
    if len(steps) <= MAX_COLUMNS:
        return steps, values
    size = -(-len(steps) // MAX_COLUMNS)
    cols = [statistics.mean(steps[i:i + size]) for i in range(0, len(steps), size)]
    out = []
    for row in values:
        binned = []
        for i in range(0, len(steps), size):
            chunk = [v for v in row[i:i + size] if v is not None]
            binned.append(statistics.mean(chunk) if chunk else None)
        out.append(binned)
    return cols, out


def _stragglers(run: RunData, index: int) -> str:
    ranks, steps, values, key = rank_times(run)
    hosts = run.hosts()
    found = detect_stragglers(run)
    named = {e["straggler_rank"] for e in found}
    what = ("own time per step (data wait + collective-free forward)" if key == "own_time_s"
            else "step time per step")
    cols, binned = _binned([float(s) for s in steps], values)
    chart = svg.heatmap([f"rank {r} {hosts.get(r, '?')}" for r in ranks], cols, binned,
                        marked=[i for i, r in enumerate(ranks) if r in named],
                        x_label=f"step ({what}, colour: vs the median rank)",
                        title="per-rank step time")
    if found:
        items = "".join(
            f"<li class='straggler-name'>rank {esc(e['straggler_rank'])} on host "
            f"<b>{esc(e.get('straggler_host'))}</b>: slower than the median rank by "
            f"{esc(_percent(e.get('slower_by', 0)))} of a step for {esc(e.get('windows', '?'))} "
            f"windows (from step {esc(e.get('step'))})</li>" for e in found)
        verdict = f"<ul class='stragglers'>{items}</ul>"
    elif len(ranks) > 1:
        verdict = "<p class='note'>No straggler: every rank within the threshold.</p>"
    else:
        verdict = "<p class='note'>One rank: no stragglers to compare.</p>"
    return _figure(f"stragglers-{index}", "Per-rank time and stragglers", chart + verdict)


def _percent(fraction: object) -> str:
    return f"{100 * fraction:.0f}%" if isinstance(fraction, int | float) else str(fraction)


def _goodput(run: RunData, index: int) -> str:
    g = run.goodput
    if not isinstance(g, dict) or not isinstance(g.get("wall_s"), int | float):
        return _figure(f"goodput-{index}", "Goodput",
                       svg.empty_chart("goodput not recorded (no goodput.json in this run)"))
    parts = g.get("parts") or {}
    lost = [(name.replace("_", " "), float(parts.get(name) or 0.0)) for name in GOODPUT_PARTS]
    chart = svg.waterfall(float(g["wall_s"]), lost, "productive")
    value = g.get("goodput")
    note = (f"<p>goodput {100 * value:.1f}% of {svg.fmt(g['wall_s'])} s wall time over "
            f"{len(g.get('attempts') or [])} attempt(s)</p>") if isinstance(
        value, int | float) else ""
    return _figure(f"goodput-{index}", "Goodput (where the wall time went)",
                   chart + note + _energy(g))


def _energy(g: dict[str, Any]) -> str:
    """The run's GPU energy, tokens per joule and CO2e (goodput.json), per attempt too."""
    e = g.get("energy")
    if not isinstance(e, dict):
        return "<p>energy: not metered (no NVML on this run's GPUs, or a CPU run)</p>"
    scaled = (f", metered on {e['gpus_sampled']} and scaled" if e["gpus_sampled"] != e["gpus"]
              else "")
    per_j = e.get("tokens_per_j")
    attempts = [a for a in g.get("attempts") or [] if "energy_kwh" in a]
    each = "; ".join(f"attempt {a['attempt']}: {a['energy_kwh']:.4g} kWh, "
                     f"{a['co2e_kg']:.3g} kg" for a in attempts) if len(attempts) > 1 else ""
    return (f"<p>energy: {e['kwh']:.4g} kWh on {e['gpus']} GPU(s){scaled}, "
            f"{f'{per_j:.4g}' if isinstance(per_j, int | float) else '-'} tokens/J, "
            f"{e['co2e_kg']:.3g} kg CO2e at {e['grid_gco2_per_kwh']:g} g/kWh "
            f"(GPU board power only){'; ' + each if each else ''}</p>")


_EXIT_COLOURS = {0: "#009E73", PREEMPTED: "#E69F00", HUNG: "#CC79A7"}


def _timeline(run: RunData) -> str:
    start = run.start_ts()
    if start is None:
        return svg.empty_chart("no timed records")
    stamps = [r["ts"] for records in run.ranks.values() for r in records[-1:]
              if isinstance(r.get("ts"), int | float)]
    info = run.exit_info or {}
    end = max([*stamps, info.get("timestamp") or start])
    attempts = []
    for a in (run.goodput or {}).get("attempts") or []:
        if isinstance(a, dict) and isinstance(a.get("start"), int | float):
            a_end = a.get("end") if isinstance(a.get("end"), int | float) else end
            attempts.append((a["start"], a_end, f"attempt {a.get('attempt')}: exit "
                             f"{a.get('exit_code')}, steps {a.get('resumed_from_step')}.."
                             f"{a.get('last_step')}", _EXIT_COLOURS.get(a.get("exit_code"),
                                                                        "#d7191c")))
            end = max(end, a_end)
    layouts = [e["ts"] for e in run.events("layout")]
    if not attempts:
        for i, t in enumerate(layouts):
            t_end = layouts[i + 1] if i + 1 < len(layouts) else end
            attempts.append((t, t_end, f"attempt {i} (from its start event)", "#0072B2"))
    marks: dict[str, list[tuple[float, float, str, str]]] = {
        "checkpoints": [(e["ts"], e["ts"], f"checkpoint at step {e.get('step')} "
                         f"({svg.fmt(e.get('write_s') or 0)} s)", "#0072B2")
                        for e in run.events("checkpoint")],
        "restarts": [(t, t, "restart", "#56B4E9") for t in layouts[1:]]
        + [(e["ts"], e["ts"], f"resumed from {e.get('checkpoint')}", "#56B4E9")
           for e in run.events("checkpoint_load")],
        "rollbacks": [(e["ts"], e["ts"], f"rollback to {e.get('checkpoint')} at step "
                       f"{e.get('from_step')}", "#d7191c") for e in run.events("rollback")],
        "bad steps": [(e["ts"], e["ts"], f"{e.get('skipped')} bad step(s) up to step "
                       f"{e.get('step')}", "#E69F00") for e in run.events("bad_steps")],
        "preemptions": [(e["ts"], e["ts"], f"preempted by {e.get('signal')} at step "
                         f"{e.get('step')}", "#E69F00") for e in run.log_events],
        "stragglers": [(e["ts"], e["ts"], f"straggler rank {e.get('straggler_rank')} on "
                        f"{e.get('straggler_host')}", "#CC79A7")
                       for e in run.events("straggler")],
    }
    if info.get("timestamp"):
        colour = _EXIT_COLOURS.get(info.get("exit_code"), "#d7191c")
        marks["end"] = [(info["timestamp"], info["timestamp"],
                         f"exit {info.get('exit_code')}: {info.get('reason')}", colour)]
    lanes = [("attempts", attempts)] + list(marks.items())
    legend = "".join(f"<li>{esc(lane)}: {esc(label)}</li>"
                     for lane, items in lanes[1:] for _, _, label, _ in items[:20])
    return (svg.timeline(lanes, (start, end), x_label="seconds since the run started")
            + (f"<ul class='events'>{legend}</ul>" if legend else ""))


def _hang(run: RunData) -> str:
    info = run.exit_info or {}
    collective = run.collective()
    if info.get("exit_code") != HUNG and collective is None:
        return ""
    extra = info.get("extra") or {}
    beats = extra.get("heartbeat_steps") or {}
    hosts = run.hosts()
    by_rank = {str(r): h for r, h in hosts.items()}
    rows = "".join(f"<tr><td>{esc(rank)}</td><td>{esc(by_rank.get(str(rank), '?'))}"
                   f"</td><td>{esc(step)}</td></tr>"
                   for rank, step in sorted(beats.items(), key=lambda kv: (len(kv[0]), kv[0])))
    lines = []
    if extra.get("suspect_rank") is not None:
        lines.append(f"<p class='hang-suspect'>The heartbeats name rank "
                     f"<b>{esc(extra['suspect_rank'])}</b> on host "
                     f"<b>{esc(extra.get('suspect_host'))}</b> (the oldest step).</p>")
    if collective is not None:
        lines.append(f"<p class='hang-collective'>Flight recorder: "
                     f"{esc(describe_collective(collective))}.</p>")
    elif run.flight_records:
        lines.append("<p class='note'>Flight recorder dumps present, all ranks level.</p>")
    return (f"<section class='hang'><h3>Hang forensics</h3><p>{esc(info.get('reason'))}"
            f"</p>{''.join(lines)}<table><tr><th>rank</th><th>host</th><th>last step "
            f"(heartbeat)</th></tr>{rows}</table><p class='note'>Thread stacks are in "
            f"logs/rank-NNN.log, flight-recorder dumps in forensics/.</p></section>")


def _link(run: RunData, rel: str, out: Path) -> str:
    target = run.root / rel
    href = os.path.relpath(target.resolve(), out.resolve().parent)
    if not href.startswith("../"):
        href = f"./{href}"  # a path, never read as a scheme (javascript:, data:)
    return f"<a href='{esc(href)}'>{esc(rel)}</a>"


def _profiles(run: RunData, out: Path) -> str:
    rows = []
    for e in sorted(run.events("profile", rank=None),
                    key=lambda e: (e.get("first_step", 0), e.get("rank", 0))):
        memory = e.get("memory_snapshot")
        rows.append(f"<tr><td>{esc(e.get('first_step'))}..{esc(e.get('last_step'))}</td>"
                    f"<td>{esc(e.get('trigger'))}</td><td>{esc(e.get('rank'))}</td>"
                    f"<td>{_link(run, str(e.get('trace')), out)}</td>"
                    f"<td>{_link(run, memory, out) if memory else ''}</td></tr>")
    for oom in sorted((run.root / "profiles").glob("oom-rank-*.pickle")):
        rows.append(f"<tr><td>out of memory</td><td>oom</td><td>{esc(oom.stem.split('-')[-1])}</td>"
                    f"<td></td><td>{_link(run, f'profiles/{oom.name}', out)}</td></tr>")
    if not rows:
        return ""
    return ("<section class='profiles'><h3>Profiles</h3><p class='note'>Traces open in "
            "chrome://tracing or ui.perfetto.dev; memory snapshots in pytorch.org/memory_viz."
            "</p><table><tr><th>steps</th><th>trigger</th><th>rank</th><th>trace</th>"
            f"<th>memory snapshot</th></tr>{''.join(rows)}</table></section>")


_PROVENANCE_KEYS = ("git_sha", "git_dirty", "hpctrain", "torch", "cuda", "nccl", "python",
                    "platform", "gpus", "hosts", "argv")


def _provenance(run: RunData) -> str:
    p = run.provenance
    if not p:
        return "<p class='note'>No provenance recorded.</p>"
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(_text(p.get(k)))}</td></tr>"
                   for k in _PROVENANCE_KEYS if k in p)
    return f"<details><summary>Provenance</summary><table>{rows}</table></details>"


def _config_diff(runs: list[RunData]) -> str:
    flats = [flatten(run.config or {}) for run in runs]
    keys = sorted({k for flat in flats for k in flat})
    missing = object()
    differ = [k for k in keys if len({repr(flat.get(k, missing)) for flat in flats}) > 1]
    head = "".join(f"<th>{esc(run.name)}</th>" for run in runs)
    rows = "".join(
        f"<tr><th>{esc(k)}</th>"
        + "".join(f"<td>{esc(_text(flat[k])) if k in flat else '<i>absent</i>'}</td>"
                  for flat in flats) + "</tr>" for k in differ)
    if not differ:
        return "<section class='config-diff'><h2>Config difference</h2><p>None.</p></section>"
    return (f"<section class='config-diff'><h2>Config difference</h2><table><tr><th>key</th>"
            f"{head}</tr>{rows}</table></section>")


def _text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def _yaml(config: dict[str, Any] | None) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False) if config else "(no config recorded)"


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:20px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top;font-size:13px}.grid{display:flex;flex-wrap:wrap;gap:12px}
figure.plot{margin:8px 0;flex:1 1 600px;max-width:780px}figcaption{font-weight:600}
svg.chart{width:100%;height:auto;background:#fff}svg.chart.empty{max-height:60px}.frame{fill:none;stroke:#bbb}
.grid line,.grid{stroke:#eee}.tick{font-size:10px;fill:#555}.axis{font-size:11px;fill:#333}
.note{color:#666}.straggler{fill:#d7191c;font-weight:700}.marked{fill:none;stroke:#d7191c;
stroke-width:1.5}.legend .key{margin-right:12px;font-size:12px}.legend i{display:inline-block;
width:12px;height:4px;margin-right:4px;vertical-align:middle}.state-done{color:#009E73}
.state-failed,.state-hung{color:#d7191c}.state-preempted{color:#E69F00}pre{background:#f6f6f6;
padding:8px;overflow:auto}ul.events{columns:2;font-size:12px;color:#444}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:3px 6px;
font-size:12px;border-radius:3px;display:none;white-space:pre}
"""

# The hover read-out: the nearest point of every series under the pointer.
_SCRIPT = """
(function () {
  var tip = document.getElementById('tip');
  document.querySelectorAll('svg.chart.line').forEach(function (chart) {
    var series = JSON.parse(chart.getAttribute('data-series'));
    chart.addEventListener('mousemove', function (ev) {
      var p = chart.createSVGPoint();
      p.x = ev.clientX; p.y = ev.clientY;
      var m = chart.getScreenCTM();
      if (!m) { return; }
      var at = p.matrixTransform(m.inverse());
      var lines = [];
      series.forEach(function (s) {
        var best = null;
        s.points.forEach(function (q) {
          if (best === null || Math.abs(q[0] - at.x) < Math.abs(best[0] - at.x)) { best = q; }
        });
        if (best !== null) {
          lines.push(s.label + ': step ' + best[2] + ', ' + best[3].toPrecision(4));
        }
      });
      tip.textContent = lines.join('\\n');
      tip.style.left = (ev.clientX + 12) + 'px';
      tip.style.top = (ev.clientY + 12) + 'px';
      tip.style.display = lines.length ? 'block' : 'none';
    });
    chart.addEventListener('mouseleave', function () { tip.style.display = 'none'; });
  });
  document.documentElement.setAttribute('data-ready', '1');
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; style-src 'unsafe-inline'; script-src '{script_hash}'">
<title>{title}</title><style>{style}</style></head>
<body>
{body}
<div id="tip"></div>
<script>{script}</script>
</body></html>
"""
