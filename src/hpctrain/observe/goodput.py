"""Goodput: where every second of a run's wall time went, over all its attempts.

An *attempt* is one life of rank 0's training process (a Slurm requeue, a torchrun or
``--max-restarts`` restart, a rerun of the command each start one). Rank 0 keeps a ledger of
its attempt in the run directory; the account over all ledgers is ``goodput.json``:

    <run>/goodput/attempt-0001.json   one ledger per attempt, rewritten in place after every step
                                      (no rename, no fsync: a kill -9 loses at most the step in
                                      flight); finished atomically at the attempt's end, or by
                                      the next attempt for one that was killed
    <run>/goodput.json                the account, written atomically at the end of each attempt

``goodput.json`` (read by the HTML report)::

    {"version": 1, "wall_s": float,
     "parts": {"productive": s, "startup": s, "checkpoint": s, "data_wait": s, "validation": s,
               "lost_work": s, "restart_gap": s, "hang": s},
     "goodput": productive / wall_s, "lost_steps": int, "saves": int,
     "checkpoint_cost_s": s | null, "restart_cost_s": s | null, "final_save_s": s,
     "attempts": [{"attempt": i, "start": unix_s, "end": unix_s, "exit_code": int | null,
                   "resumed_from_step": int | null, "last_step": int,
                   "startup_parts": {part: s}}]}

``startup_parts`` splits an attempt's start-up, in the order they happen (``STARTUP_PARTS``):
``start`` (process start, imports, the run directory's lock; the process group too for ranks
started by srun or torchrun, which join it before the lock), ``process_group``, ``model_build``
(model, parallelism, optimizer, data), ``checkpoint_load`` (what is left of finding, verifying
and loading the checkpoint once the model is built: its files are read and checked from the
trainer's creation on), ``compile_cache`` (loading a saved compile cache), ``other`` (up to the
loop), and ``first_step``: the first step of the attempt, compilation included (it runs inside
it; the compile cache shortens it). A part that did not happen is absent.

``checkpoint_cost_s`` is what one periodic save cost the run (the checkpoint part over the saves
that count, less the end of an attempt's flush: the final save and the wait for the writes in
flight, paid once per attempt however often the run saves, so not a cost of the interval);
``final_save_s`` what the ends of attempts cost (part of checkpoint): the final save's stall and the
wait for the writes still in flight, over all attempts (a background final save overlaps with
the last validation; only the wait for it after that is charged); ``restart_cost_s`` what one
restart cost (the gap before it and its start-up), or the
first start-up when the run never restarted: the inputs of ``hpctrain plan interval`` and
``hpctrain plan goodput --from-run``.

The parts sum to ``wall_s`` (by construction: each interval of an attempt is charged to exactly
one part, and gaps between attempts to ``restart_gap``):

- productive: step time (forward, backward, update, logging) of the steps that count, less the
  slowdown below and the first logging window's excess;
- startup: process start to the first step (imports, process group, model build, checkpoint
  load), the first logging window's excess over the attempt's typical window (compile, warm-up),
  laying out the writer's buffers, and the attempt's exit;
- checkpoint: the loop blocked on saves (staging copy, waiting for the previous save, blocking
  saves) plus the measured slowdown of steps while a background write ran: logging windows with
  a write in flight against the mean of those without; and the flush at the attempt's end;
- data_wait, validation: waiting for batches, evaluation;
- lost_work: steps computed again. After a restart: all its previous attempt did after the
  checkpoint the restart resumed from. After a rollback: the steps since the restored checkpoint,
  and the restore;
- restart_gap: from the end of an attempt to the start of the next in the same allocation (a
  Slurm job's restarts, torchrun or ``--max-restarts`` restarts). A requeue into a new
  allocation, or running the command again, adds nothing: the job did not hold the devices;
- hang: from the last step of an attempt to the watchdog's exit (exit code 124).

Energy (``energy``, null when no attempt was metered): the GPUs' board energy during each
attempt's training loop, read by rank 0 through NVML (observe/power.py ``EnergyMeter``) on the
GPUs it sees and scaled to all the job's GPUs (``gpus / gpus_sampled``: exact on one node under
the local launcher or torchrun, where rank 0 sees them all; across nodes, or where Slurm binds
one GPU per task, rank 0's share times the number of shares, an estimate where ranks differ,
e.g. pipeline stages). CO2e = kWh x ``metrics.grid_gco2_per_kwh`` of that attempt; tokens are
those trained, work later lost included (its energy was spent).

Metrics event (rank 0, at the end of a completed run): ``{"event": "goodput", ...}`` with the
fields of ``goodput.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from hpctrain.records import BadRecord, Bool, Int, List, Map, Real, Record, Str
from hpctrain.runtime.exit_codes import HUNG
from hpctrain.runtime.exit_info import exit_info_or_none
from hpctrain.runtime.rundir import write_json_atomic
from hpctrain.runtime.runlock import current_attempt
from hpctrain.runtime.safe_open import UnsafeRunPath, make_dir, read_bytes
from hpctrain.shown import quoted

log = logging.getLogger("hpctrain.goodput")

VERSION = 1
PARTS = ("productive", "startup", "checkpoint", "data_wait", "validation", "lost_work",
         "restart_gap", "hang")
LEDGER_DIR = "goodput"
ACCOUNT = "goodput.json"
_LEDGER = re.compile(r"attempt-(\d{4,})\.json")
# Seconds charged since the last mark, by bucket; the step-window buckets are split at the end.
_TIMES = ("startup", "warmup_s", "clean_s", "dirty_s", "open_s", "data_wait", "validation",
          "checkpoint", "flush", "lost_work")
_COUNTS = ("warmup_n", "clean_n", "dirty_n", "open_n", "saves", "final_saves")
STARTUP_PARTS = ("start", "process_group", "model_build", "checkpoint_load", "compile_cache",
                 "other", "first_step")
# What a restart or rollback moves into lost_work when the steps after a checkpoint are lost.
_TRANSFER = ("warmup_s", "clean_s", "dirty_s", "open_s", "data_wait", "validation",
             "checkpoint")
# An attempt's ledger as ``GoodputClock._state`` writes it; keys added later are optional
# (ledgers of older versions are still read). Times are seconds, counts whole.
_BUCKETS = Record({k: Real(0.0, optional=k in ("flush", "final_saves"))
                   for k in _TIMES + _COUNTS})
LEDGER = Record({
    "version": Int(VERSION, VERSION),
    "attempt": Int(1),
    "allocation": Str(256, optional=True),
    "pid": Int(0, 2**31 - 1, optional=True),
    "start": Real(0.0),
    "updated": Real(0.0),
    "end": Real(0.0, optional=True),
    "ended": Bool(optional=True),
    "exit_code": Int(-(2**31), 2**31 - 1, optional=True, nullable=True),
    "resumed_from_step": Int(optional=True, nullable=True),
    "last_step": Int(optional=True),
    "buckets": _BUCKETS,
    "open_dirty": Bool(optional=True),
    "rollbacks": List(Record({"from_step": Int(), "to_step": Int(), "lost_steps": Int(),
                              "lost_s": Real(0.0), "restore_s": Real(0.0)}),
                      max_len=100_000, optional=True),
    "hang_s": Real(0.0, optional=True),
    "marks": Map(Str(32), Map(Str(32), Real(0.0)), optional=True),
    "startup_parts": Map(Str(32), Real(0.0), optional=True),
    "energy": Record({"joules": Real(0.0), "gpus_sampled": Int(1), "gpus": Int(1),
                      "tokens": Real(0.0), "grid_gco2_per_kwh": Real(0.0)}, optional=True),
})
# ``goodput.json``, as ``compute_goodput`` writes it (read back by ``report`` and ``runs``).
ACCOUNT_RECORD = Record({
    "version": Int(VERSION, VERSION),
    "wall_s": Real(0.0),
    "parts": Record({k: Real(0.0) for k in PARTS}),
    "goodput": Real(0.0, 1.0),
    # Fields added after the first release: optional, so older accounts are still read.
    "lost_steps": Int(optional=True),
    "saves": Int(optional=True),
    "checkpoint_cost_s": Real(optional=True, nullable=True),
    "restart_cost_s": Real(optional=True, nullable=True),
    "final_save_s": Real(0.0, optional=True),
    "energy": Record({"kwh": Real(0.0), "joules": Real(0.0), "tokens": Real(0.0),
                      "tokens_per_j": Real(0.0, nullable=True), "co2e_kg": Real(0.0),
                      "grid_gco2_per_kwh": Real(0.0), "gpus": Int(1), "gpus_sampled": Int(1),
                      "attempts_measured": Int(1)}, optional=True, nullable=True),
    "attempts": List(Record({
        "attempt": Int(1), "start": Real(0.0), "end": Real(0.0),
        "exit_code": Int(-(2**31), 2**31 - 1, nullable=True),
        "resumed_from_step": Int(nullable=True), "last_step": Int(),
        "startup_parts": Map(Str(32), Real(0.0), optional=True),
        "energy_kwh": Real(0.0, optional=True), "co2e_kg": Real(0.0, optional=True),
        "tokens": Real(0.0, optional=True)}), max_len=100_000),
})
# Checkpoint marks kept (a resume may fall back past damaged ones; retention keeps fewer).
_MARKS = 16


def allocation_id(environ: dict[str, str] | None = None) -> str:
    """Which allocation this process runs in: restarts inside one share it, a requeue does not."""
    attempt = current_attempt(environ)
    if attempt.job is None:
        return f"process:{os.getpid()}"  # a plain command: every run its own allocation
    return f"{attempt.job}#{attempt.attempt[0]}"


class GoodputClock:
    """Charges the time of one attempt to its parts (rank 0 keeps a ledger on disk)."""

    def __init__(self, ledger: Path | None = None, *, start: float | None = None,
                 attempt: int = 1, allocation: str = ""):
        self.start = start if start is not None else time.time()
        self._mark = self.start
        self.buckets: dict[str, float] = dict.fromkeys(_TIMES + _COUNTS, 0.0)
        self.open_dirty = False
        self.windows = 0
        self.marks: dict[str, dict[str, float]] = {}
        self.rollbacks: list[dict[str, Any]] = []
        self.resumed_from: int | None = None
        self.last_step = 0
        self.attempt = attempt
        self.allocation = allocation
        self.finished = False
        self._ledger = ledger
        self._fd: int | None = None
        self._size = 0
        self._marks_json: str | None = None  # serialised once per change, not per step
        self.startup_parts: dict[str, float] = {}
        self._startup_mark = self.start
        self.energy: Any = None  # an observe.power.EnergyMeter (rank 0), see meter_energy
        self._energy_info: dict[str, float] = {}
        self._steps = 0  # steps trained in this attempt (tokens for tokens per joule)

    @classmethod
    def open(cls, run_dir: Path) -> GoodputClock:
        """Rank 0's clock: a new attempt ledger under ``run_dir/goodput/`` (killed attempts
        before it finished from ``exit_info.json``), started at this process's start."""
        folder = Path(run_dir) / LEDGER_DIR
        make_dir(folder)  # a link there is refused (safe_open.py)
        start = psutil.Process().create_time()
        finish_killed(Path(run_dir), before=start)
        for _ in range(100):
            number = max((n for n, _ in _ledgers(folder)), default=0) + 1
            path = folder / f"attempt-{number:04d}.json"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
                break
            except FileExistsError:
                continue
        else:
            raise RuntimeError(f"no free attempt number in {folder}")
        clock = cls(path, start=start, attempt=number, allocation=allocation_id())
        clock._fd = fd
        clock._persist()
        return clock

    # -- charging -----------------------------------------------------------------------------

    def _charge(self, bucket: str) -> float:
        now = time.time()
        spent = max(0.0, now - self._mark)
        self.buckets[bucket] += spent
        self._mark = now
        return spent

    def startup_part(self, name: str) -> None:
        """The start-up part ``name`` (one of ``STARTUP_PARTS``) ends now (its time is what
        passed since the previous part ended, or since the process started)."""
        now = time.time()
        self.startup_parts[name] = (self.startup_parts.get(name, 0.0)
                                    + max(0.0, now - self._startup_mark))
        self._startup_mark = now

    def started(self, resumed_from: int | None) -> None:
        """The loop starts: all time so far was start-up."""
        self.resumed_from = resumed_from
        self.last_step = resumed_from or 0
        self.startup_part("other")
        self._charge("startup")
        self.marks["start"] = self._snapshot()
        self._marks_json = None
        self._persist()

    def meter_energy(self, meter: Any, *, tokens_per_step: float, gpus: int,
                     grid_gco2_per_kwh: float) -> None:
        """Record in this attempt's ledger the energy ``meter`` reads (an EnergyMeter on rank
        0's GPUs, stopped by :meth:`finish`), for ``gpus`` GPUs in all, and the tokens."""
        self.energy = meter
        self._energy_info = {"gpus_sampled": len(meter.devices), "gpus": gpus,
                             "tokens_per_step": tokens_per_step,
                             "grid_gco2_per_kwh": grid_gco2_per_kwh}

    @contextlib.contextmanager
    def part(self, bucket: str) -> Iterator[None]:
        """Charge the time inside to ``bucket`` (time before it belongs to the current step)."""
        self._charge("open_s")
        try:
            yield
        finally:
            self._charge(bucket)

    def step_done(self, step: int, writing: bool) -> None:
        """A step ended (``writing``: a background save was in flight)."""
        self._charge("open_s")
        if "first_step" not in self.startup_parts:
            self.startup_part("first_step")
        self.buckets["open_n"] += 1
        self._steps += 1
        self.open_dirty |= writing
        self.last_step = step
        self._persist()

    def window_closed(self) -> None:
        """A logging window ended after its host sync: its steps' time is known."""
        self._charge("open_s")
        if self.buckets["open_n"]:
            kind = "warmup" if self.windows == 0 else ("dirty" if self.open_dirty else "clean")
            self.buckets[f"{kind}_s"] += self.buckets["open_s"]
            self.buckets[f"{kind}_n"] += self.buckets["open_n"]
            self.buckets["open_s"] = self.buckets["open_n"] = 0.0
            self.windows += 1
        self.open_dirty = False

    def saved(self, step: int, background: bool, periodic: bool = True) -> None:
        """A save of ``step`` was made (charged already): the work before it is safe.
        ``periodic=False``: the final save, charged to "flush", not a save of the interval."""
        self.buckets["saves" if periodic else "final_saves"] += 1
        self.open_dirty |= background
        self.marks[str(step)] = self._snapshot()
        for key in [k for k in self.marks if k != "start"][:-_MARKS]:
            del self.marks[key]
        self._marks_json = None

    def rolled_back(self, from_step: int, to_step: int, restore_s: float) -> None:
        """Steps ``to_step+1..from_step`` are discarded: their time becomes lost work."""
        mark = self.marks.get(str(to_step), self.marks.get("start"))
        lost = _transfer(self.buckets, mark) if mark else 0.0
        self.rollbacks.append({"from_step": from_step, "to_step": to_step,
                               "lost_steps": from_step - to_step, "lost_s": lost + restore_s,
                               "restore_s": restore_s})
        self.marks = {k: v for k, v in self.marks.items() if k == "start" or int(k) < to_step}
        self.marks[str(to_step)] = self._snapshot()
        self._marks_json = None
        self.last_step = to_step
        self._persist()

    def checkpoint_cost(self) -> float | None:
        """Measured seconds a save costs the run so far (stall + slowdown), per save."""
        if not self.buckets["saves"]:
            return None
        parts = _parts(self._state())
        return (parts["checkpoint"] - self.buckets["flush"]) / self.buckets["saves"]

    def finish(self, exit_code: int) -> dict[str, Any] | None:
        """End the attempt (its exit charged to start-up); on rank 0 close the ledger, write
        ``goodput.json`` and return it. Only the first call counts."""
        if self.finished:
            return None
        self.finished = True
        self._stop_energy()
        self._charge("startup")
        self.window_closed()
        if self._ledger is None:
            return None
        state = self._state()
        state.update(ended=True, exit_code=exit_code, end=self._mark)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        write_json_atomic(self._ledger, state)
        run_dir = self._ledger.parent.parent
        account = compute_goodput(run_dir)
        write_json_atomic(run_dir / ACCOUNT, account)
        return account

    def discard(self) -> None:
        """Forget this attempt: close and remove its ledger, leave ``goodput.json`` as it is (a
        run refused before its first step does not count in the account of the run there)."""
        self.finished = True
        self._stop_energy()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._ledger is not None:
            self._ledger.unlink(missing_ok=True)

    def _stop_energy(self) -> None:
        """Stop the meter (its last reading is taken then), once."""
        if self.energy is not None and not self._energy_info.get("stopped"):
            self._energy_info["stopped"] = 1
            self.energy.stop()

    # -- the ledger ---------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, float]:
        return dict(self.buckets)

    def _state(self, marks: bool = True) -> dict[str, Any]:
        state = {"version": VERSION, "attempt": self.attempt, "allocation": self.allocation,
                 "pid": os.getpid(), "start": self.start, "updated": self._mark,
                 "ended": False, "exit_code": None, "resumed_from_step": self.resumed_from,
                 "last_step": self.last_step, "buckets": dict(self.buckets),
                 "open_dirty": self.open_dirty, "rollbacks": self.rollbacks, "hang_s": 0.0,
                 "startup_parts": self.startup_parts}
        if marks:
            state["marks"] = self.marks
        if self.energy is not None:
            info = self._energy_info
            state["energy"] = {"joules": self.energy.joules(),
                               "gpus_sampled": info["gpus_sampled"], "gpus": info["gpus"],
                               "tokens": self._steps * info["tokens_per_step"],
                               "grid_gco2_per_kwh": info["grid_gco2_per_kwh"]}
        return state

    def _persist(self) -> None:
        if self._fd is None:
            return
        if self._marks_json is None:
            self._marks_json = json.dumps(self.marks)
        text = json.dumps(self._state(marks=False))
        data = f'{text[:-1]}, "marks": {self._marks_json}}}'.encode()
        # In place and padded: readers after a kill see one whole JSON document.
        padded = data.ljust(self._size)
        os.pwrite(self._fd, padded, 0)
        self._size = max(self._size, len(data))


def _transfer(buckets: dict[str, float], mark: dict[str, float]) -> float:
    """Move what ``buckets`` gained since ``mark`` into lost_work; return the seconds moved."""
    moved = 0.0
    for key in _TRANSFER + _COUNTS:
        if key not in buckets:  # a ledger written before the key existed
            continue
        delta = max(0.0, buckets[key] - mark.get(key, 0.0))
        buckets[key] -= delta
        if key in _TIMES:
            moved += delta
    buckets["lost_work"] += moved
    return moved


def _parts(state: dict[str, Any]) -> dict[str, float]:
    """One attempt's parts from its buckets (warm-up excess and slowdown split off)."""
    b = dict(state["buckets"])
    open_kind = "dirty" if state.get("open_dirty") else "clean"
    b[f"{open_kind}_s"] += b["open_s"]
    b[f"{open_kind}_n"] += b["open_n"]
    per_step = None
    if b["clean_n"]:
        per_step = b["clean_s"] / b["clean_n"]
    elif b["dirty_n"]:
        per_step = b["dirty_s"] / b["dirty_n"]  # every window saw a write: none to compare
    slowdown = warm = 0.0
    if per_step is not None:
        slowdown = max(0.0, b["dirty_s"] - b["dirty_n"] * per_step)
        warm = max(0.0, b["warmup_s"] - b["warmup_n"] * per_step)
    steps = b["warmup_s"] + b["clean_s"] + b["dirty_s"]
    return {"productive": steps - slowdown - warm, "startup": b["startup"] + warm,
            "checkpoint": b["checkpoint"] + b.get("flush", 0.0) + slowdown,
            "data_wait": b["data_wait"],
            "validation": b["validation"], "lost_work": b["lost_work"],
            "restart_gap": 0.0, "hang": state.get("hang_s", 0.0)}


def _ledgers(folder: Path) -> list[tuple[int, Path]]:
    found = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _LEDGER.fullmatch(path.name)
            if match:
                found.append((int(match[1]), path))
    return sorted(found)


def _read(path: Path) -> dict[str, Any] | None:
    """A ledger checked against ``LEDGER``; None (with a warning) when it is damaged."""
    try:
        return read_ledger(path)
    except BadRecord as e:
        log.warning("goodput: %s; that attempt is left out", e.what)
        return None


def read_ledger(path: Path) -> dict[str, Any]:
    """The ledger at ``path``, checked; BadRecord when it is unreadable or damaged."""
    try:
        state = json.loads(read_bytes(path))  # never through a link planted in the run dir
    except UnsafeRunPath as e:
        raise BadRecord(e.what) from None
    except (OSError, ValueError) as e:
        raise BadRecord(f"{path} is unreadable ({quoted(str(e))})") from None
    state = LEDGER.check(state, path)
    if state.get("ended") and "end" not in state:
        raise BadRecord(f"{path}: ended = true without an end time")
    return state


def set_aside(path: Path, why: str) -> Path:
    """Rename a damaged ledger to ``<name>.damaged[-N]`` (kept, no longer read); returns it."""
    for n in range(1000):
        target = path.with_name(f"{path.name}.damaged" + (f"-{n}" if n else ""))
        if not target.exists():
            os.rename(path, target)
            log.warning("goodput: %s; kept as %s, a new ledger is started", why, target.name)
            return target
    raise OSError(f"no free name to set {path} aside")


def _exit_info(run_dir: Path) -> dict[str, Any] | None:
    return exit_info_or_none(run_dir / "exit_info.json")


def _close_killed(state: dict[str, Any], info: dict[str, Any] | None,
                  before: float | None) -> dict[str, Any]:
    """An attempt that never finished its ledger: end it at its last update, or at a later
    exit_info.json of its own (a watchdog's: the time since the last step was a hang)."""
    state = {**state, "ended": True, "end": state["updated"]}
    ts = info.get("timestamp") if info else None
    if isinstance(ts, int | float) and state["updated"] <= ts and (before is None or ts <= before):
        state["exit_code"] = info.get("exit_code")
        if info.get("exit_code") == HUNG:
            state["hang_s"] = ts - state["updated"]
            state["end"] = ts
    return state


def finish_killed(run_dir: Path, before: float) -> None:
    """Close the ledgers of earlier attempts that were killed (rank 0 of a new attempt)."""
    info = _exit_info(run_dir)
    for _, path in _ledgers(run_dir / LEDGER_DIR):
        try:
            state = read_ledger(path)
        except BadRecord as e:
            set_aside(path, e.what)
            continue
        if not state.get("ended") and state["start"] < before:
            write_json_atomic(path, _close_killed(state, info, before))


def compute_goodput(run_dir: Path) -> dict[str, Any]:
    """The account of every attempt found under ``run_dir`` (the ``goodput.json`` schema)."""
    run_dir = Path(run_dir)
    states = [s for _, p in _ledgers(run_dir / LEDGER_DIR) if (s := _read(p)) is not None]
    info = _exit_info(run_dir)
    states = [s if s.get("ended") else _close_killed(s, info, None) for s in states]
    parts = dict.fromkeys(PARTS, 0.0)
    lost_steps = 0
    saves = flush = final_saves = 0.0
    attempts = []
    restarts = []  # (gap before, start-up) of every attempt but the first
    gap = 0.0
    for i, state in enumerate(states):
        following = states[i + 1] if i + 1 < len(states) else None
        own = gap
        gap = 0.0
        if following is not None:
            lost_steps += _lose_after_restart(state, following)
            if following.get("allocation") == state.get("allocation"):
                gap = max(0.0, following["start"] - state["end"])
                parts["restart_gap"] += gap
        lost_steps += sum(r["lost_steps"] for r in state.get("rollbacks", []))
        saves += state["buckets"]["saves"]
        # .get: ledgers written before the flush existed
        flush += state["buckets"].get("flush", 0.0)
        final_saves += state["buckets"].get("final_saves", 0.0)
        mine = _parts(state)
        restarts.append(own + mine["startup"])
        for key, value in mine.items():
            parts[key] += value
        attempts.append({"attempt": state["attempt"], "start": state["start"],
                         "end": state["end"], "exit_code": state.get("exit_code"),
                         "resumed_from_step": state.get("resumed_from_step"),
                         "last_step": state.get("last_step", 0),
                         "startup_parts": state.get("startup_parts", {}),
                         **_attempt_energy(state.get("energy"))})
    wall = sum(parts.values())
    return {"version": VERSION, "wall_s": wall, "parts": parts,
            "goodput": parts["productive"] / wall if wall > 0 else 0.0,
            "lost_steps": lost_steps, "saves": int(saves),
            "checkpoint_cost_s": _save_cost(parts["checkpoint"], flush, saves, final_saves),
            "restart_cost_s": (sum(restarts[1:]) / len(restarts[1:]) if len(restarts) > 1
                               else restarts[0] if restarts else None),
            "final_save_s": flush,
            "energy": _run_energy(states, attempts),
            "attempts": attempts}


def _attempt_energy(energy: dict[str, Any] | None) -> dict[str, float]:
    """An attempt's kWh (scaled to all its GPUs), CO2e and tokens; {} when not metered."""
    if not energy:
        return {}
    kwh = energy["joules"] * energy["gpus"] / energy["gpus_sampled"] / 3.6e6
    return {"energy_kwh": kwh, "co2e_kg": kwh * energy["grid_gco2_per_kwh"] / 1000,
            "tokens": energy["tokens"]}


def _run_energy(states: list[dict[str, Any]],
                attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's energy over its metered attempts (None when none was metered)."""
    metered = [(s["energy"], a) for s, a in zip(states, attempts, strict=True)
               if s.get("energy")]
    if not metered:
        return None
    kwh = sum(a["energy_kwh"] for _, a in metered)
    tokens = sum(a["tokens"] for _, a in metered)
    last = metered[-1][0]
    return {"kwh": kwh, "joules": kwh * 3.6e6, "tokens": tokens,
            "tokens_per_j": tokens / (kwh * 3.6e6) if kwh > 0 else None,
            "co2e_kg": sum(a["co2e_kg"] for _, a in metered),
            "grid_gco2_per_kwh": last["grid_gco2_per_kwh"], "gpus": last["gpus"],
            "gpus_sampled": last["gpus_sampled"], "attempts_measured": len(metered)}


def _save_cost(checkpoint: float, flush: float, saves: float,
               final_saves: float) -> float | None:
    """Seconds per periodic save; for a run whose only saves were final ones, theirs."""
    if saves:
        return (checkpoint - flush) / saves
    return flush / final_saves if final_saves else None


def _lose_after_restart(state: dict[str, Any], following: dict[str, Any]) -> int:
    """Move the work ``state`` did after the step ``following`` resumed from into lost_work
    (in ``state``'s buckets); return the number of steps lost."""
    resumed = following.get("resumed_from_step") or 0
    first = state.get("resumed_from_step") or 0
    last = state.get("last_step", 0)
    if last <= resumed:
        return 0
    marks = state.get("marks", {})
    mark = marks.get(str(resumed)) if resumed >= first else None
    mark = mark or marks.get("start")
    if mark is None:
        return 0
    buckets = dict(state["buckets"])
    _transfer(buckets, mark)
    state["buckets"] = buckets
    state["open_dirty"] = False
    return last - max(resumed, first)


def summary(account: dict[str, Any]) -> str:
    """One line for the end of a run: goodput and where the rest went."""
    wall = account["wall_s"] or 1.0
    parts = account["parts"]
    rest = ", ".join(f"{name.replace('_', ' ')} {parts[name] / wall:.1%}" for name in PARTS[1:]
                     if parts[name] > 0)
    attempts = len(account["attempts"])
    lost = f"; {account['lost_steps']} steps lost" if account["lost_steps"] else ""
    energy = account.get("energy")
    spent = (f"; GPUs {energy['kwh']:.3g} kWh, {energy['tokens_per_j'] or 0:.3g} tokens/J, "
             f"{energy['co2e_kg']:.3g} kg CO2e" if energy else "")
    return (f"goodput {account['goodput']:.1%} of {_duration(account['wall_s'])} over "
            f"{attempts} attempt{'s' if attempts != 1 else ''} ({rest}{lost}){spent}")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
