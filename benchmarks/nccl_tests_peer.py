"""nccl-tests built from source on the GPU machine, beside `hpctrain bench collective`: the same
GPUs, sizes and dtype in one call (issue 15 item 4: busbw within 3% at >= 64 MiB for
all_reduce, all_gather and reduce_scatter).

    python3 benchmarks/nccl_tests_peer.py --nproc 4 --out runs/nccl-peer   # carry .nccltests
    python3 benchmarks/nccl_tests_peer.py --build-only --out /tmp/nt       # only compile

The nccl-tests sources are NVIDIA's and are not committed: they travel in ``.nccltests/``
(ignored by git; ``.nccltests/PROVENANCE.md`` says where each file came from). The script
builds them with ``make MPI=0`` against the CUDA toolkit that holds ``nvcc`` and the NCCL of
the ``nvidia-nccl-cu13`` wheel (the one PyTorch loads; the wheel ships ``libnccl.so.2`` only,
so a link farm under ``<out>/nccl_home`` supplies ``libnccl.so``), runs
``<op>_perf -b 64M -e 1G -f 2 -g N -d bfloat16`` (one process driving all N GPUs, no MPI),
then ``python -m hpctrain bench collective --nproc N`` with the same sizes, and prints a
Markdown table: nccl-tests busbw out-of-place and in-place, ours, their ratio and whether it is
within the tolerance. Both sides count bytes the nccl-tests way (S = the total buffer for
all_gather / reduce_scatter). torch.distributed has no out-of-place all_reduce, so that row
compares in-place with in-place; the others compare out-of-place with out-of-place. Timing
differs in one detail, said here so nobody has to guess: nccl-tests reports the mean time per
call over 20 back-to-back calls averaged over the GPUs, ours the slowest rank's median of 20.

Every process it starts runs with NVLink multicast off (MULTICAST_OFF). Writes, under --out:
``build/`` (binaries), ``<op>_perf.txt`` (nccl-tests' output), ``ours/collective.json``, and
``nccl_tests_peer.json`` (the table's rows, both sides' rows and the commands). On 4 H100/H200
expect about 1 minute to build (16 cores) and 3-4 minutes of runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from hpctrain.errors import HpctrainError  # noqa: E402
from hpctrain.runtime.env import MULTICAST_OFF  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")
MIB = 1024**2
# The columns of one nccl-tests result, out-of-place then in-place (common.cu's BenchTime).
MODE_FIELDS = ("time_us", "algbw", "busbw", "wrong")


class PeerError(HpctrainError):
    """nccl-tests cannot be built or run here (no nvcc, no NCCL headers, no source tree)."""


def parse_table(text: str) -> list[dict]:
    """Rows of an nccl-tests result table (``<op>_perf`` output); comments and logs skipped.

    A row is ``size count type [redop [root]]`` then, per mode, ``time algbw busbw #wrong``:
    out-of-place then in-place (8 numbers), or in-place alone (4) where a version leaves
    out-of-place blank. Older versions print no root (all_reduce) or neither redop nor root
    (all_gather); ``#wrong`` may read ``N/A`` when the check is off.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tokens = line.split()
        if len(tokens) < 7 or not (tokens[0].isdigit() and tokens[1].isdigit()):
            continue
        n_metrics = 8 if len(tokens) >= 11 else 4
        n_labels = len(tokens) - 3 - n_metrics
        if n_labels not in (0, 1, 2):
            continue
        labels = tokens[3:3 + n_labels]
        try:
            values = [_number(t) for t in tokens[3 + n_labels:]]
            root = int(labels[1]) if n_labels == 2 else None
        except ValueError:
            continue  # a log line that happens to start with two integers
        row: dict = {"size": int(tokens[0]), "count": int(tokens[1]), "type": tokens[2],
                     "redop": labels[0] if labels else None, "root": root}
        modes = ("oop", "ip") if n_metrics == 8 else ("ip",)
        for mode in ("oop", "ip"):
            for field in MODE_FIELDS:
                row[f"{mode}_{field}"] = None
        for i, mode in enumerate(modes):
            time_us, algbw, busbw, wrong = values[4 * i:4 * i + 4]
            row.update({f"{mode}_time_us": time_us, f"{mode}_algbw": algbw,
                        f"{mode}_busbw": busbw,
                        f"{mode}_wrong": None if wrong is None else int(wrong)})
        rows.append(row)
    return rows


def _number(token: str) -> float | None:
    if token == "N/A":
        return None
    return float(token)


def compare(peer: dict[str, list[dict]], ours: list[dict], *, min_bytes: int = 64 * MIB,
            tolerance: float = 0.03) -> list[dict]:
    """One row per op and size in both results: the two busbw values and their ratio.

    Like is compared with like: out-of-place where we measured it, else in-place. ``within``
    (None below ``min_bytes``) is ``|ours / nccl-tests - 1| <= tolerance``: faster by more than
    the tolerance is as suspicious as slower.
    """
    mine = {(r["op"], r["size"]): r for r in ours}
    out = []
    for op, rows in peer.items():
        for ref in rows:
            r = mine.get((op, ref["size"]))
            if r is None:
                continue
            mode = "oop" if r.get("oop_busbw") is not None else "ip"
            theirs, ours_bw = ref.get(f"{mode}_busbw"), r.get(f"{mode}_busbw")
            ratio = ours_bw / theirs if theirs and ours_bw is not None else None
            checked = ref["size"] >= min_bytes and ratio is not None
            out.append({
                "op": op, "size": ref["size"], "mode": mode,
                "nccl_tests_oop_busbw": ref.get("oop_busbw"),
                "nccl_tests_ip_busbw": ref.get("ip_busbw"),
                "nccl_tests_wrong": _sum_wrong(ref), "ours_wrong": _sum_wrong(r),
                "ours_oop_busbw": r.get("oop_busbw"), "ours_ip_busbw": r.get("ip_busbw"),
                "ratio": ratio,
                "within": abs(ratio - 1) <= tolerance if checked else None,
            })
    return out


def _sum_wrong(row: dict) -> int | None:
    values = [row.get(f"{m}_wrong") for m in ("oop", "ip")]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def markdown(rows: list[dict], tolerance: float) -> str:
    """The comparison as a Markdown table (GB/s)."""

    def num(value: float | None, fmt: str = ".1f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [f"| op | size | nccl-tests busbw out-of-place | in-place | ours out-of-place | "
             f"in-place | ours / nccl-tests | within {tolerance:.0%} |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        within = {None: "-", True: "yes", False: "**no**"}[r["within"]]
        lines.append(
            f"| {r['op']} | {_size(r['size'])} | {num(r['nccl_tests_oop_busbw'])} | "
            f"{num(r['nccl_tests_ip_busbw'])} | {num(r['ours_oop_busbw'])} | "
            f"{num(r['ours_ip_busbw'])} | {num(r['ratio'], '.3f')} ({r['mode']}) | {within} |")
    return "\n".join(lines)


def _version(v: object) -> str:
    """torch.cuda.nccl.version(): a (major, minor, patch) tuple, an int in older releases."""
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# The GPU side: locate the toolchain, build, run both benchmarks.


def cuda_home() -> Path:
    """The CUDA toolkit of ``nvcc`` (the folder holding bin/nvcc and include/cuda_runtime.h)."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"),
                  str(Path(os.path.realpath(nvcc)).parents[1]) if nvcc else None,
                  "/usr/local/cuda"]
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file() and \
                (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c)
    raise PeerError("no CUDA toolkit found" + ("" if nvcc else " (nvcc is not on PATH)"),
                    expected="nvcc and include/cuda_runtime.h under one folder",
                    hint="set CUDA_HOME to the toolkit, e.g. CUDA_HOME=/usr/local/cuda-13.0")


def cuda_lib(home: Path) -> Path:
    """The folder holding libcudart.so inside the toolkit."""
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        if (home / sub / "libcudart.so").exists():
            return home / sub
    raise PeerError(f"no libcudart.so under {home}", expected="lib64/libcudart.so",
                    hint="point CUDA_HOME at a full CUDA toolkit")


def nccl_home(stage: Path) -> tuple[Path, Path]:
    """(NCCL_HOME for make, the folder of the real library) from the nvidia-nccl wheel.

    ``nvidia.nccl`` is a namespace package (no __file__): its folder is ``__path__[0]``.
    """
    try:
        import nvidia.nccl as wheel  # type: ignore[import-not-found]
    except ImportError as exc:
        raise PeerError("the NCCL wheel is not importable (import nvidia.nccl failed)",
                        expected="nvidia-nccl-cu13 installed beside torch",
                        hint="run with the python that holds PyTorch") from exc
    root = Path(list(wheel.__path__)[0])
    header = root / "include" / "nccl.h"
    libs = sorted((root / "lib").glob("libnccl.so*"))
    if not header.is_file() or not libs:
        raise PeerError(f"no NCCL headers or library under {root}",
                        expected="include/nccl.h and lib/libnccl.so.2",
                        hint="reinstall nvidia-nccl-cu13 (pip keeps the headers)")
    stage.mkdir(parents=True, exist_ok=True)
    for name, target in (("include", root / "include"),):
        link = stage / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    lib = stage / "lib"
    lib.mkdir(exist_ok=True)
    real = libs[-1]
    for name in ("libnccl.so", "libnccl.so.2"):
        link = lib / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real)
    return stage, real.parent


def build(tree: Path, out: Path, ops: list[str], jobs: int) -> tuple[Path, dict[str, str]]:
    """Compile ``<op>_perf`` for each op into ``<out>/build``; return it and the run env."""
    if not (tree / "src" / "common.cu").is_file() or not (tree / "Makefile").is_file():
        raise PeerError(f"no nccl-tests tree at {tree}",
                        expected="Makefile, src/common.cu, verifiable/ (see the module doc)",
                        hint="carry .nccltests to the GPU machine (device tool carry list)")
    for tool in ("make", "g++"):
        if shutil.which(tool) is None:
            raise PeerError(f"{tool} is not on PATH",
                            expected="make and g++ (nvcc's host compiler)",
                            hint="install build-essential, or build where they exist")
    home = cuda_home()
    staged, real_lib = nccl_home(out / "nccl_home")
    bin_dir = out / "build"
    argv = ["make", "-C", str(tree), "MPI=0", f"CUDA_HOME={home}", f"CUDA_LIB={cuda_lib(home)}",
            f"NCCL_HOME={staged}", "NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90",
            f"BUILDDIR={bin_dir}", f"BIN_FILES_LIST={' '.join(ops)}", f"-j{jobs}"]
    env = {**os.environ, **MULTICAST_OFF}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(staged / "lib"), str(real_lib), str(cuda_lib(home)), env.get("LD_LIBRARY_PATH", "")])
    print("$", " ".join(argv), flush=True)
    from hpctrain.bench.common import run_command

    code, tail, wall = run_command(argv, timeout=1800, env=env)
    missing = [op for op in ops if not (bin_dir / f"{op}_perf").is_file()]
    if code != 0 or missing:
        raise PeerError(f"building nccl-tests failed (make exit {code}; missing {missing}):\n"
                        f"{tail}", hint="read the compiler output above")
    print(f"  built in {wall:.0f} s", flush=True)
    return bin_dir, env


def run_peer(bin_dir: Path, env: dict[str, str], out: Path, op: str, args: argparse.Namespace,
             nproc: int) -> tuple[list[str], list[dict]]:
    """Run one ``<op>_perf`` on all GPUs; save its output; return (argv, parsed rows)."""
    argv = [str(bin_dir / f"{op}_perf"), "-b", args.begin, "-e", args.end, "-f", str(args.factor),
            "-g", str(nproc), "-d", args.dtype, "-w", str(args.warmup), "-n", str(args.iters)]
    print("$", " ".join(argv), flush=True)
    # One process (it drives every GPU itself), so a plain timeout ends it; the whole output is
    # kept, NCCL's log lines included, for the parser and the record.
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{op}_perf ran past {args.timeout:.0f} s") from exc
    text = proc.stdout + proc.stderr
    (out / f"{op}_perf.txt").write_text(text)
    rows = parse_table(proc.stdout)
    if proc.returncode != 0 or not rows:
        raise PeerError(f"{op}_perf failed (exit {proc.returncode}, {len(rows)} rows):\n"
                        f"{text[-3000:]}")
    return argv, rows


def run_ours(out: Path, args: argparse.Namespace, nproc: int) -> tuple[list[str], list[dict]]:
    """``hpctrain bench collective`` with the same sizes; return (argv, rows)."""
    folder = out / "ours"
    argv = [sys.executable, "-m", "hpctrain", "bench", "collective", "--nproc", str(nproc),
            "--ops", *args.ops, "-b", args.begin, "-e", args.end, "-f", str(args.factor),
            "-d", args.dtype, "-w", str(args.warmup), "-n", str(args.iters), "--device", "cuda",
            "--no-plot", "--out", str(folder)]
    env = {**os.environ, **MULTICAST_OFF}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    print("$", " ".join(argv[1:]), flush=True)
    from hpctrain.bench.common import run_command

    code, tail, _ = run_command(argv, timeout=args.timeout, env=env, cwd=REPO)
    result = folder / "collective.json"
    if code != 0 or not result.is_file():
        raise PeerError(f"hpctrain bench collective failed (exit {code}):\n{tail}")
    return argv, json.loads(result.read_text())["rows"]


def main() -> None:
    """Build nccl-tests, run it and our benchmark, print and write the comparison."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None, help="GPUs (default: all visible)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("-b", "--begin", default="64M")
    p.add_argument("-e", "--end", default="1G")
    p.add_argument("-f", "--factor", type=int, default=2)
    p.add_argument("-d", "--dtype", default="bfloat16", help="nccl-tests -d name (and ours)")
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--tree", type=Path, default=REPO / ".nccltests", help="nccl-tests sources")
    p.add_argument("--out", type=Path, default=Path("runs/nccl-peer"))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="make -j")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark run")
    p.add_argument("--build-only", action="store_true", help="compile, run nothing")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        bin_dir, env = build(args.tree.resolve(), out, args.ops, args.jobs)
        if args.build_only:
            return
        import torch

        nproc = args.nproc or torch.cuda.device_count()
        if nproc < 2 or nproc > torch.cuda.device_count():
            raise PeerError(f"--nproc {nproc} with {torch.cuda.device_count()} GPUs visible",
                            expected="2..the number of visible GPUs")
        peer = {op: run_peer(bin_dir, env, out, op, args, nproc) for op in args.ops}
        ours_argv, ours = run_ours(out, args, nproc)
    except PeerError as exc:
        sys.exit(str(exc))
    rows = compare({op: rows for op, (_, rows) in peer.items()}, ours,
                   tolerance=args.tolerance)
    print(f"\n{nproc} x {torch.cuda.get_device_name(0)}, {args.dtype}, busbw GB/s\n")
    print(markdown(rows, args.tolerance))
    checked = [r["within"] for r in rows if r["within"] is not None]
    print(f"\nwithin {args.tolerance:.0%} at >= 64 MiB: {sum(checked)}/{len(checked)}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0),
            "gpus": nproc, "dtype": args.dtype, "torch": torch.__version__,
            "nccl": _version(torch.cuda.nccl.version()), "tolerance": args.tolerance,
            "provenance": str(args.tree / "PROVENANCE.md")}
    report = {"meta": meta, "rows": rows, "ours": {"argv": ours_argv, "rows": ours},
              "nccl_tests": {op: {"argv": argv, "rows": r} for op, (argv, r) in peer.items()}}
    (out / "nccl_tests_peer.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"results: {out / 'nccl_tests_peer.json'}")


if __name__ == "__main__":
    main()
