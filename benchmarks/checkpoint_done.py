"""Issue 30's "Done when", measured on one GPU host (1, 2 or 4 GPUs) through real `hpctrain
train` runs, as a user pays it.

Phases (``--phases``, comma-separated, run in the order given; each writes ``<out>/<phase>.json``
as soon as it is measured):

- ``default``: `configs/llama-1b.yaml` with its default checkpointing (``checkpoint.interval``
  auto) for ``--steps`` (2,000) steps; ``none``: the same with checkpoints off. Asked together on
  a host with >= 2 GPUs, the two run AT THE SAME TIME, on GPU 0 and GPU 1 (half the device
  time; the table says so), else one after the other. From each: the steady tokens/s (rank 0's
  step records' wall clock, steps WARMUP..last), goodput.json, the saves (``checkpoint`` events:
  bytes, write time, GB/s) and the interval's reason from the log.
- energy, during every run: nvidia-smi's board power (``power.draw``) polled every 0.2 s by this
  script and integrated, read at the start and end of the window goodput's energy covers, beside
  goodput.json's kWh (target: within 5%). That window is one attempt's training loop: from the
  first reading of rank 0's meter, taken just before the first step (after imports, process group,
  model build, checkpoint load, compile-cache load: the attempt's ``start`` + its start-up parts
  up to ``other``), to its last reading when the attempt ends (after the last step, the final
  save's wait and the last validation: the attempt's ``end``). Compilation inside the first step
  is in it; the process start and model build are not.
- ``resume``: the default run resumed for 20 more steps (its checkpoint's pages dropped from the
  page cache first): restore GB/s (checkpoint bytes / ``checkpoint_load`` seconds: what the run
  waits for once the model is built; the checkpoint is read and its checksums checked from the
  model build on, overlapping it) and the resumed time to first step against the cold run's.
- ``8b``: `configs/llama-8b-fsdp.yaml`, FSDP on all GPUs: a cold run of ``--big-steps`` steps whose
  only save is the final one, then a resume of 10 steps: save and restore GB/s per node (all
  ranks' bytes over the slowest rank), cold vs resumed start-up. Where the fp32 state (16 bytes a
  parameter with AdamW) would not fit the GPUs, or its 12-byte-a-parameter checkpoint the disk,
  it trains with ``train.master_weights=bf16`` and says so.
- ``disk``: ``hpctrain bench disk`` on ``--work``'s file system (where the checkpoints go), as
  ``disk-<host>.json``; run it in each call, beside the checkpoints it is compared with.

Every training process gets fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``: a
resume finds only the compile cache its run directory holds, as a requeued job on another node
does.

    B=benchmarks/checkpoint_done.py; W=--work=runs/ckdone; O=--out=$OUT/ckdone
    python3 $B --phases default,none,resume,disk $W $O     # call 1 (>= 2 GPUs: ~7 min)
    python3 $B --phases 8b,disk $W $O                      # call 2 (~5 min)
    python3 $B --report --out DIR                          # the Markdown table (both calls' JSON)
    python3 $B --cpu-smoke --work /tmp/ckd --out /tmp/ckd/out   # every phase on CPU (checks it)

On one GPU, ``default`` and ``none`` take ~5 min each: put ``default,resume,disk`` in call 1 and
``none`` in call 2; 8b does not fit one 80 GB GPU (nor its checkpoint a 64 GB disk).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from as_measured import AS_MEASURED  # the llama configs' values before auto
from ckpt_runs import CPU_TINY, all_ranks, events, run_train, step_records
from hpctrain.bench.disk import disk_results, drop_cached, run_disk

WARMUP = {"gpu": 50, "cpu": 10}  # steps 1..WARMUP hold compilation and the first windows
PHASES = ("default", "none", "resume", "8b", "disk")
MODELS = {"gpu": {"1b": ["configs/llama-1b.yaml", *AS_MEASURED["configs/llama-1b.yaml"],
                         "data.max_bytes=200000000"],
                  "8b": ["configs/llama-8b-fsdp.yaml", *AS_MEASURED["configs/llama-8b-fsdp.yaml"],
                         "data.max_bytes=200000000"]},
          "cpu": {"1b": CPU_TINY, "8b": [*CPU_TINY, "parallel.strategy=fsdp"]}}
OFF = ["checkpoint.interval=none", "checkpoint.save_at_end=false"]
RESUME_STEPS = {"1b": 20, "8b": 10}
PARAMS_8B = 8.03e9
TARGETS = {"steady_ratio": 0.99, "goodput": 0.95, "save_vs_disk": 0.8, "restore_vs_disk": 0.8,
           "startup_ratio": 1 / 3, "energy_within": 0.05}


class SmiEnergy:
    """nvidia-smi's power readings polled in a thread and integrated (trapezoids) into a
    running energy per GPU: [(unix time, {GPU index: joules since the first reading})].

    nvidia-smi has no energy counter to query (driver 580: "total_energy_consumption is not a
    valid field"), and NVML's counter is what hpctrain's own meter reads; the board power that
    nvidia-smi prints, sampled every 0.2 s, is the independent reference."""

    QUERY = ["nvidia-smi", "--query-gpu=index,power.draw", "--format=csv,noheader,nounits"]

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SmiEnergy:
        """Start polling (no-op without nvidia-smi)."""
        if shutil.which("nvidia-smi") is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        last: tuple[float, dict[int, float]] | None = None
        while not self._stop.is_set():
            before = time.time()
            try:
                text = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10,
                                      check=True).stdout
            except (OSError, subprocess.SubprocessError):
                text = ""
            after = time.time()
            watts = parse_smi(text)
            if watts:  # the reading's time: the middle of the call
                last = self.add((before + after) / 2, watts, last)
            self._stop.wait(self.interval_s)

    def add(self, t: float, watts: dict[int, float],
            last: tuple[float, dict[int, float]] | None) -> tuple[float, dict[int, float]]:
        """Fold one power reading at time ``t`` into the running energies; the new last."""
        joules = dict(self.samples[-1][1]) if self.samples else {}
        for gpu, w in watts.items():
            before = last[1].get(gpu) if last is not None else None
            joules[gpu] = joules.get(gpu, 0.0) + (
                (t - last[0]) * (before + w) / 2 if before is not None else 0.0)
        self.samples.append((t, joules))
        return t, watts

    def stop(self) -> list[tuple[float, dict[int, float]]]:
        """Stop polling; the samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples


def parse_smi(text: str) -> dict[int, float]:
    """{GPU index: watts} from nvidia-smi's ``index, W`` lines ([N/A] lines skipped)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = float(parts[1])
            except ValueError:
                continue
    return out


def counter_at(samples: list[tuple[float, dict[int, float]]], t: float, gpu: int
               ) -> float | None:
    """GPU ``gpu``'s counter (J) at time ``t``, linear between the readings around it (None
    outside them)."""
    points = [(ts, c[gpu]) for ts, c in samples if gpu in c]
    for (t0, j0), (t1, j1) in zip(points, points[1:], strict=False):
        if t0 <= t <= t1:
            return j0 if t1 == t0 else j0 + (j1 - j0) * (t - t0) / (t1 - t0)
    return None


def energy_window(attempt: dict) -> tuple[float, float]:
    """(start, end) unix times of what goodput's energy covers in one attempt: its training
    loop, from the start-up parts before the first step to the attempt's end."""
    before_loop = sum(s for part, s in attempt.get("startup_parts", {}).items()
                      if part != "first_step")
    return attempt["start"] + before_loop, attempt["end"]


def energy_check(account: dict, attempt: int, samples: list[tuple[float, dict[int, float]]],
                 gpus: list[int]) -> dict | None:
    """goodput.json's kWh for one attempt beside nvidia-smi's over the same window (None where
    either is missing)."""
    entry = account["attempts"][attempt]
    ours = entry.get("energy_kwh")
    if ours is None or not samples or not gpus:
        return None
    t0, t1 = energy_window(entry)
    joules = 0.0
    for gpu in gpus:
        a, b = counter_at(samples, t0, gpu), counter_at(samples, t1, gpu)
        if a is None or b is None:
            return {"kwh": ours, "window_s": t1 - t0, "smi_kwh": None,
                    "why": "nvidia-smi's readings do not span the window"}
        joules += b - a
    smi = joules / 3.6e6
    return {"kwh": ours, "smi_kwh": smi, "ratio": ours / smi if smi > 0 else None,
            "window_s": t1 - t0, "gpus": gpus}


def steady(run_dir: Path, warmup: int) -> dict:
    """Tokens/s per GPU over steps ``warmup``..last from rank 0's step records' wall clock."""
    records = {r["step"]: r for r in step_records(run_dir)}
    last = max(records)
    layout = events(run_dir, "layout")[-1]
    seconds = records[last]["ts"] - records[warmup]["ts"]
    return {"steps": last, "warmup": warmup, "steady_s": seconds,
            "tokens_per_s": (last - warmup) * layout["tokens_per_step_per_gpu"] / seconds}


def saves(run_dir: Path) -> dict:
    """Per save (by step): all ranks' bytes, the slowest rank's write and stall, GB/s per node."""
    by_step: dict[int, list[dict]] = {}
    for e in all_ranks(run_dir, "checkpoint"):
        by_step.setdefault(e["step"], []).append(e)
    out = []
    for step, ranks in sorted(by_step.items()):
        size = sum(e["bytes"] for e in ranks)
        write = max(e["write_s"] for e in ranks)
        out.append({"step": step, "bytes": size, "write_s": write, "gbps": size / write / 1e9,
                    "stall_s": max(e.get("stall_s", 0.0) for e in ranks),
                    "writer": ranks[0].get("writer"), "ranks": len(ranks)})
    return {"saves": out}


def interval_lines(run_dir: Path) -> list[str]:
    """What rank 0's log says about when it saved (the interval chosen and why)."""
    log = run_dir / "logs" / "rank-000.log"
    if not log.is_file():
        return []
    keep = ("checkpoint interval", "saving a checkpoint", "committed")
    return [line.strip() for line in log.read_text(errors="replace").splitlines()
            if any(k in line for k in keep)][:20]


def time_to_first_step(attempt: dict) -> float:
    """Process start to the end of the attempt's first step (all its start-up parts)."""
    return sum(attempt.get("startup_parts", {}).values())


def checkpoint_bytes(run_dir: Path) -> tuple[Path, int]:
    """The newest committed checkpoint of a run and its size on disk."""
    root = run_dir / "checkpoints"
    step = root / (root / "latest").read_text().strip()
    return step, sum(f.stat().st_size for f in step.rglob("*") if f.is_file())


class Phases:
    """The phases of one call, their runs under ``work`` and their JSON under ``out``."""

    def __init__(self, mode: str, work: Path, out: Path, steps: int, big_steps: int,
                 big_args: list[str]):
        self.mode = mode
        self.work = work
        self.out = out
        self.steps = steps
        self.big_steps = big_steps
        self.big_args = big_args
        self.gpus = gpu_inventory() if mode == "gpu" else []
        self.host = socket.gethostname()
        self.cache_n = 0

    def env(self, gpus: list[int], port: int | None = None) -> dict[str, str]:
        """A training process's environment: its GPUs, fresh compile caches, its port."""
        self.cache_n += 1
        caches = self.work / "caches" / f"{self.cache_n:02d}"
        shutil.rmtree(caches, ignore_errors=True)
        env = {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
               "TRITON_CACHE_DIR": str(caches / "triton"),
               # nvidia-smi numbers GPUs by PCI bus; so must CUDA, or GPU 1 could be another one
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if self.mode == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        if port is not None:
            env["MASTER_PORT"] = str(port)
        return env

    def write(self, name: str, result: dict) -> None:
        """Keep one phase's result (with where and when it ran)."""
        self.out.mkdir(parents=True, exist_ok=True)
        result = {"phase": name, "host": self.host, "date": time.strftime("%Y-%m-%d %H:%M"),
                  "device": self.gpus[0]["name"] if self.gpus else "cpu (smoke)",
                  "gpus_on_host": len(self.gpus), **result}
        (self.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {self.out / f'{name}.json'}", flush=True)

    # -- 1b: default checkpointing vs none -----------------------------------------------------

    def one_b(self, names: list[str]) -> None:
        """The default and/or none runs: together on GPUs 0 and 1 when both are asked and the
        host has two GPUs, else one after the other."""
        together = len(names) == 2 and (self.mode == "cpu" or len(self.gpus) >= 2)
        jobs = {name: ([i if together else 0], 29511 + i) for i, name in enumerate(names)}
        smi = SmiEnergy().start()
        results: dict[str, dict] = {}
        errors: list[BaseException] = []

        def run(name: str) -> None:
            gpus, port = jobs[name]
            try:
                extra = [f"train.steps={self.steps}", *(OFF if name == "none" else [])]
                start = time.time()
                run_dir = run_train(self.work, f"1b-{name}", [*MODELS[self.mode]["1b"], *extra],
                                    env=self.env(gpus, port))
                results[name] = {"run_dir": str(run_dir), "gpus": gpus, "wall_s":
                                 time.time() - start, "together": together}
            except BaseException as e:  # noqa: BLE001 - raised below, after the other run
                errors.append(e)

        threads = [threading.Thread(target=run, args=(n,)) for n in names]
        for t in threads:
            t.start()
            if not together:
                t.join()
        for t in threads:
            t.join()
        samples = smi.stop()
        for name, res in results.items():
            run_dir = Path(res["run_dir"])
            account = json.loads((run_dir / "goodput.json").read_text())
            res.update(steady(run_dir, WARMUP[self.mode]), **saves(run_dir),
                       goodput=account["goodput"], goodput_parts=account["parts"],
                       final_save_s=account["final_save_s"], periodic_saves=account["saves"],
                       time_to_first_step_s=time_to_first_step(account["attempts"][0]),
                       startup_parts=account["attempts"][0]["startup_parts"],
                       energy=energy_check(account, 0, samples, res["gpus"]),
                       log=interval_lines(run_dir))
            if together:
                res["beside"] = [n for n in names if n != name]
            self.write(name, res)
        if errors:
            raise errors[0]

    # -- resumes -------------------------------------------------------------------------------

    def resume(self, run_dir: Path, model: str, args: list[str], gpus: list[int],
               ranks: int = 1) -> dict:
        """Resume a finished run for a few more steps from its newest checkpoint, its pages
        dropped from the page cache first: restore GB/s, cold vs resumed start-up, energy."""
        cold = json.loads((run_dir / "goodput.json").read_text())
        step_dir, size = checkpoint_bytes(run_dir)
        for f in step_dir.rglob("*"):
            if f.is_file():
                drop_cached(f)
        steps = cold["attempts"][-1]["last_step"] + RESUME_STEPS[model]
        smi = SmiEnergy().start()
        try:
            run_train(self.work, run_dir.name, [*args, f"train.steps={steps}",
                                                "checkpoint.save_at_end=false"],
                      ranks=ranks, env=self.env(gpus), fresh=False)
        finally:
            samples = smi.stop()
        account = json.loads((run_dir / "goodput.json").read_text())
        loads = all_ranks(run_dir, "checkpoint_load")
        load_s = max(e["load_s"] for e in loads)  # a fresh run loads nothing: all the resume's
        first, again = account["attempts"][0], account["attempts"][-1]
        return {"checkpoint": step_dir.name, "checkpoint_bytes": size, "restore_s": load_s,
                "restore_gbps": size / load_s / 1e9,
                "cold_first_step_s": time_to_first_step(first),
                "resumed_first_step_s": time_to_first_step(again),
                "cold_parts": first["startup_parts"], "resumed_parts": again["startup_parts"],
                "startup_ratio": time_to_first_step(again) / time_to_first_step(first),
                "compile_cache": [line.strip() for line in
                                  (run_dir / "logs" / "rank-000.log").read_text(
                                      errors="replace").splitlines() if "compile cache" in line],
                "energy": energy_check(account, len(account["attempts"]) - 1, samples, gpus)}

    def resume_1b(self) -> None:
        """The default 1b run resumed."""
        run_dir = self.work / "1b-default"
        if not (run_dir / "goodput.json").is_file():
            sys.exit(f"no {run_dir}: run the default phase first (in the same call)")
        self.write("resume", {"model": "1b", **self.resume(run_dir, "1b", MODELS[self.mode]["1b"],
                                                           [0])})

    # -- 8b ------------------------------------------------------------------------------------

    def big(self) -> None:
        """8b FSDP on all GPUs: a cold run whose one save is the final one, then a resume."""
        if self.mode == "gpu" and len(self.gpus) < 2:
            sys.exit("the 8b phase needs >= 2 GPUs: its fp32 state is 128 GB, its checkpoint "
                     "96 GB")
        ranks = len(self.gpus) if self.mode == "gpu" else 2
        gpus = list(range(ranks))
        choice, why = self.big_choice(ranks)
        args = [*MODELS[self.mode]["8b"], *choice, *self.big_args]
        smi = SmiEnergy().start()
        try:
            run_dir = run_train(self.work, "8b", [*args, f"train.steps={self.big_steps}", *OFF[:1]],
                                ranks=ranks, env=self.env(gpus))
        finally:
            samples = smi.stop()
        account = json.loads((run_dir / "goodput.json").read_text())
        cold = {**saves(run_dir), "choice": choice + self.big_args, "why": why, "ranks": ranks,
                "energy_cold": energy_check(account, 0, samples, gpus)}
        self.write("8b", {"model": "8b", **cold,
                          **self.resume(run_dir, "8b", [*args, *OFF[:1]], gpus, ranks)})

    def big_choice(self, ranks: int) -> tuple[list[str], str]:
        """The 8b overrides that fit this host: fp32 master weights where 16 bytes a parameter
        (plus 16 GB of activations and buffers) fit 90% of each GPU and the 12-byte-a-parameter
        checkpoint the disk, else bf16 master weights (8 and 6 bytes)."""
        if self.mode == "cpu":
            return [], "cpu smoke: the tiny model"
        per_gpu = 16 * PARAMS_8B / ranks / 1e9 + 16
        memory = min(g["memory_gb"] for g in self.gpus)
        free = shutil.disk_usage(self.work).free / 1e9
        if per_gpu <= 0.9 * memory and 0.9 * free >= 12 * PARAMS_8B / 1e9:
            return [], (f"fp32 master weights: ~{per_gpu:.0f} GB a GPU of {memory:.0f} GB, "
                        f"a {12 * PARAMS_8B / 1e9:.0f} GB checkpoint on {free:.0f} GB free")
        return ["train.master_weights=bf16"], (
            f"fp32 master weights would need ~{per_gpu:.0f} GB a GPU of {memory:.0f} GB and a "
            f"{12 * PARAMS_8B / 1e9:.0f} GB checkpoint on {free:.0f} GB free: bf16 master weights "
            f"(params, grads, AdamW moments in bf16; a {6 * PARAMS_8B / 1e9:.0f} GB checkpoint)")

    # -- disk ----------------------------------------------------------------------------------

    def disk(self) -> None:
        """bench disk on the work folder's file system."""
        self.work.mkdir(parents=True, exist_ok=True)
        size = 8 << 30 if self.mode == "gpu" else 64 << 20
        rows = run_disk(self.work, size, threads=8, echo=print)
        res = disk_results(rows, self.work)
        self.write(f"disk-{self.host}", {"path": str(self.work), "fs_type": res.meta["fs_type"],
                                         "rows": res.rows})


def gpu_inventory() -> list[dict]:
    """[{index, name, memory_gb}] from nvidia-smi, by PCI bus order ([] without it)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in text.splitlines():
        index, name, mib = (p.strip() for p in line.split(","))
        gpus.append({"index": int(index), "name": name, "memory_gb": float(mib) * 2**20 / 1e9})
    return gpus


# -- the report ------------------------------------------------------------------------------------

def load(out: Path) -> dict[str, dict]:
    """Every phase's JSON under ``out`` by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def fmt(value: object, spec: str) -> str:
    """A number formatted, or '-'."""
    return format(value, spec) if isinstance(value, int | float) else "-"


def verdict(ok: bool | None) -> str:
    """met / MISSED / - (not measured)."""
    return "-" if ok is None else "met" if ok else "MISSED"


def disk_for(results: dict[str, dict], host: str) -> dict[str, dict] | None:
    """bench disk's write and read rows on ``host`` (else any host's), by op."""
    disks = [r for k, r in results.items() if k.startswith("disk-")]
    same = [r for r in disks if r["host"] == host] or disks
    return {row["op"]: row for row in same[-1]["rows"]} if same else None


def report(out: Path) -> str:
    """The Markdown for benchmarks/RESULTS.md from whatever phases are under ``out``."""
    res = load(out)
    if not res:
        sys.exit(f"no results under {out}: run some --phases first")
    lines: list[str] = []
    first = next(iter(res.values()))
    lines.append(f"### {first['device']}, {first['date']} (`benchmarks/checkpoint_done.py`)")
    default, none = res.get("default"), res.get("none")
    if default or none:
        together = bool(default and none and default.get("together"))
        lines += ["", "1b (`configs/llama-1b.yaml`), "
                  f"{(default or none)['steps']} steps, steady = steps "
                  f"{(default or none)['warmup']}..last by rank 0's wall clock; "
                  + ("both runs AT THE SAME TIME on GPU 0 (default) and GPU 1 (none)."
                     if together else "one after the other on GPU 0."), "",
                  "| checkpointing | steady tokens/s | vs none | goodput | time to first step s "
                  "| final save wait s | periodic saves | saves: GB, write s, GB/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in (("default (interval auto)", default), ("none", none)):
            if r is None:
                continue
            ratio = (r["tokens_per_s"] / none["tokens_per_s"]) if none else None
            made = "; ".join(f"step {s['step']}: {s['bytes'] / 1e9:.1f}, {s['write_s']:.1f}, "
                             f"{s['gbps']:.2f}" for s in r["saves"]) or "-"
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {fmt(ratio, '.4f')} | "
                         f"{r['goodput']:.3f} | {r['time_to_first_step_s']:.1f} | "
                         f"{r['final_save_s']:.1f} | {r['periodic_saves']} | {made} |")
        if default:
            ratio = default["tokens_per_s"] / none["tokens_per_s"] if none else None
            lines += ["", f"steady >= {TARGETS['steady_ratio']}: "
                      f"{verdict(None if ratio is None else ratio >= TARGETS['steady_ratio'])}; "
                      f"goodput >= {TARGETS['goodput']}: "
                      f"{verdict(default['goodput'] >= TARGETS['goodput'])}. "
                      f"Goodput parts s: " + ", ".join(
                          f"{k} {v:.1f}" for k, v in default["goodput_parts"].items() if v),
                      "", "The default run's log on when to save:", ""]
            lines += [f"    {line}" for line in default["log"]] or ["    (nothing)"]
    saving = [(k, res[k]) for k in ("default", "resume", "8b") if k in res]
    if any(r.get("saves") or r.get("restore_gbps") for _, r in saving):
        lines += ["", "Save and restore beside `hpctrain bench disk` on the same path (GB/s per "
                  "node; save = all ranks' bytes over the slowest rank's write, restore = the "
                  "checkpoint's bytes over the slowest rank's load: what it waits for once the "
                  "model is built, the checkpoint being read and checked from the model build "
                  "on; its pages dropped from the page cache first):", "",
                  "| model | layout | checkpoint GB | save GB/s | vs disk write | restore GB/s "
                  "| vs disk read | disk write / read GB/s (method) |", "|---|---|---|---|---|---|"
                  "---|---|"]
        for key, r in saving:
            if key == "default" and "resume" in res:
                continue  # the resume row carries the default run's save
            disk = disk_for(res, r["host"])
            save = (r.get("saves") or res.get("default", {}).get("saves") or [None])[-1]
            write = disk["write"]["gbps"] if disk else None
            read = disk["read"]["gbps"] if disk else None
            save_gbps = save["gbps"] if save else None
            restore = r.get("restore_gbps")
            layout = (f"FSDP {r['ranks']} GPUs" + (f" ({' '.join(r['choice'])})"
                                                   if r.get("choice") else "")
                      if key == "8b" else "1 GPU")
            size = r.get("checkpoint_bytes") or (save["bytes"] if save else None)
            lines.append(
                f"| {r.get('model', '1b')} | {layout} | {fmt(size and size / 1e9, '.1f')} | "
                f"{fmt(save_gbps, '.2f')} | {fmt(save_gbps and write and save_gbps / write, '.2f')}"
                f" | {fmt(restore, '.2f')} | {fmt(restore and read and restore / read, '.2f')} | "
                + (f"{write:.2f} / {read:.2f} ({disk['write']['method']}; "
                   f"{disk['read']['method']})" if disk else "-") + " |")
        if "8b" in res:
            lines += ["", f"8b: {res['8b']['why']}."]
    starts = [(k, res[k]) for k in ("resume", "8b") if k in res]
    if starts:
        lines += ["", "Time to first step (process start to the end of the first step, "
                  "goodput.json `startup_parts`), cold vs resumed (compile cache from the run "
                  "directory, fresh local inductor/Triton caches); target <= 1/3:", "",
                  *(["(The 1b cold start ran beside the none run's, sharing the host's CPUs "
                     "with its compilation.)", ""] if default and default.get("together")
                    else []),
                  "| model | cold s | resumed s | ratio | target | cold parts s "
                  "| resumed parts s |",
                  "|---|---|---|---|---|---|---|"]
        for _, r in starts:
            cold, again = (", ".join(f"{k} {v:.1f}" for k, v in r[key].items())
                           for key in ("cold_parts", "resumed_parts"))
            lines.append(f"| {r['model']} | {r['cold_first_step_s']:.1f} | "
                         f"{r['resumed_first_step_s']:.1f} | {r['startup_ratio']:.2f} | "
                         f"{verdict(r['startup_ratio'] <= TARGETS['startup_ratio'])} | {cold} | "
                         f"{again} |")
    energy = [(label, e) for label, e in (
        ("1b default", (default or {}).get("energy")), ("1b none", (none or {}).get("energy")),
        ("1b resumed", res.get("resume", {}).get("energy")),
        ("8b cold", res.get("8b", {}).get("energy_cold")),
        ("8b resumed", res.get("8b", {}).get("energy"))) if e]
    if energy:
        lines += ["", "Energy: goodput.json's kWh beside nvidia-smi's power readings integrated "
                  "over the same window (one attempt's training loop: first step to the end of "
                  "the attempt, final save and last validation included; not the process start "
                  "or model build); within 5%:", "",
                  "| run | window s | goodput kWh | nvidia-smi kWh | ratio | within 5% |",
                  "|---|---|---|---|---|---|"]
        for label, e in energy:
            ratio = e.get("ratio")
            lines.append(f"| {label} | {e['window_s']:.0f} | {e['kwh']:.4f} | "
                         f"{fmt(e.get('smi_kwh'), '.4f')} | {fmt(ratio, '.4f')} | "
                         f"{verdict(None if ratio is None else abs(ratio - 1) <= 0.05)} |")
    return "\n".join(lines)


def main() -> None:
    """Run the phases asked for (or print the table of those measured)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="default,none,resume,disk",
                   help=f"comma-separated, in order: {', '.join(PHASES)}")
    p.add_argument("--work", type=Path, default=Path("runs/ckdone"),
                   help="run directories and checkpoints (the disk measured)")
    p.add_argument("--out", type=Path, default=Path("runs/ckdone/out"),
                   help="each phase's JSON")
    p.add_argument("--steps", type=int, default=2000, help="1b steps per run")
    p.add_argument("--big-steps", type=int, default=20, help="8b steps of the cold run")
    p.add_argument("--big-args", default="", help="more overrides for 8b, space-separated")
    p.add_argument("--report", action="store_true", help="print the Markdown of what is in --out")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="every phase with the tiny model on CPU (checks the script)")
    args = p.parse_args()
    out = args.out.resolve()
    if args.report:
        print(report(out))
        return
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    mode = "cpu" if args.cpu_smoke else "gpu"
    steps = 40 if args.cpu_smoke else args.steps
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = Phases(mode, work, out, steps, 12 if args.cpu_smoke else args.big_steps,
                 args.big_args.split())
    if mode == "gpu" and not run.gpus:
        sys.exit("no GPU found by nvidia-smi (use --cpu-smoke to check the script on CPU)")
    one_b = [x for x in phases if x in ("default", "none")]
    done = False
    for phase in phases:
        if phase in one_b:
            if not done:
                run.one_b(one_b)
                done = True
        elif phase == "resume":
            run.resume_1b()
        elif phase == "8b":
            run.big()
        else:
            run.disk()
    print(report(out))


if __name__ == "__main__":
    main()
