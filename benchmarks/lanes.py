"""Run benchmark commands in lanes: each lane its own GPUs, its commands one after another.

    python benchmarks/lanes.py start runs/lanes \\
        --lane 0,1 "python3 benchmarks/observe_gpu.py --only hang" \\
            "python3 benchmarks/checkpoint.py --layout fsdp2 --variants probe,none,process" \\
        --lane 2,3 "python3 benchmarks/peers/compare.py --layouts 8b-tp2 8b-pp2 --steps 40"
    python benchmarks/lanes.py wait runs/lanes --seconds 540 --tar "$OUT/lanes.tgz"

A 4-GPU machine runs two 2-GPU lanes at once: twice the measurements per GPU-hour. The lanes
share the host's CPUs, memory and disk (never a GPU), so a result names the lanes beside it.

``start`` detaches (a new session, so the commands outlive the shell that started them) and
returns; each lane writes ``lane-N.log`` with a timestamped line per command and its exit
code, and the last lane to finish writes ``DONE``. ``wait`` returns when DONE exists or after
``--seconds``, prints each lane's tail, and can pack everything the lanes wrote under the folder
(``results/`` is theirs to fill: ``$LANE_RESULTS`` in each command's environment) into one
tarball. That suits a remote runner that returns files only from a folder of its own, and only
a few. Every command runs with NVLink multicast off (``MULTICAST_OFF``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from hpctrain.runtime.env import MULTICAST_OFF


def start(folder: Path, lanes: list[list[str]]) -> None:
    """Start every lane in the background, detached; return at once."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "started").exists():
        sys.exit(f"{folder} holds lanes already (remove it or choose another folder)")
    (folder / "results").mkdir(exist_ok=True)
    (folder / "started").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    script = [f"cd {shlex.quote(os.getcwd())}"]
    for key, value in MULTICAST_OFF.items():
        script.append(f"export {key}={shlex.quote(value)}")
    script.append(f"export LANE_RESULTS={shlex.quote(str(folder / 'results'))}")
    for i, (gpus, *commands) in enumerate(lanes):
        body = [f"export CUDA_VISIBLE_DEVICES={shlex.quote(gpus)}"]
        for cmd in commands:
            body.append(f"echo \"=== $(date +%T) start: \"{shlex.quote(cmd)}")
            body.append(f"( {cmd} ); rc=$?; echo \"=== $(date +%T) exit $rc\"")
        log = shlex.quote(str(folder / f"lane-{i}.log"))
        script.append("( " + "\n".join(body) + f" ) > {log} 2>&1 &")
    script.append(f"wait; touch {shlex.quote(str(folder / 'DONE'))}")
    (folder / "lanes.sh").write_text("\n".join(script) + "\n")
    subprocess.Popen(["bash", str(folder / "lanes.sh")], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    print(f"started {len(lanes)} lane(s); logs in {folder}/lane-N.log")


def wait(folder: Path, seconds: float, tar: Path | None, tail: int) -> None:
    """Wait for DONE (or ``seconds``), print each lane's tail, pack the folder if asked."""
    if not (folder / "started").exists():
        sys.exit(f"no lanes started in {folder}")
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (folder / "DONE").exists():
        time.sleep(2)
    state = "done" if (folder / "DONE").exists() else "still running"
    print(f"lanes {state} at {time.strftime('%H:%M:%S')}")
    for log in sorted(folder.glob("lane-*.log")):
        text = log.read_text(errors="replace")
        print(f"##### {log.name}\n{text[-tail:]}")
    if tar is not None:
        with tarfile.open(tar, "w:gz") as tf:
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    tf.add(path, arcname=str(path.relative_to(folder)))
        print(f"packed {folder} into {tar}")


def _lanes(argv: list[str]) -> list[list[str]]:
    lanes: list[list[str]] = []
    for arg in argv:
        if arg == "--lane":
            lanes.append([])
        elif not lanes:
            sys.exit("commands come after --lane GPUS (e.g. --lane 0,1 'cmd' 'cmd')")
        else:
            lanes[-1].append(arg)
    for lane in lanes:
        if len(lane) < 2 or not all(g.isdigit() for g in lane[0].split(",")):
            sys.exit(f"a lane is --lane GPUS CMD [CMD ...] with GPUS like 0,1; got {lane}")
    return lanes


def main() -> None:
    """``start`` lanes, or ``wait`` for them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("start", help="start lanes: --lane GPUS CMD [CMD ...] ...")
    s.add_argument("folder", type=Path)
    w = sub.add_parser("wait", help="wait for the lanes, print their tails")
    w.add_argument("folder", type=Path)
    w.add_argument("--seconds", type=float, default=540)
    w.add_argument("--tar", type=Path, default=None)
    w.add_argument("--tail", type=int, default=2500, help="characters of each log to print")
    args, rest = p.parse_known_args()
    if args.what == "start":
        start(args.folder.resolve(), _lanes(rest))
    else:
        if rest:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        wait(args.folder.resolve(), args.seconds, args.tar, args.tail)


if __name__ == "__main__":
    main()
