"""benchmarks/nccl_tests_peer.py: nccl-tests' table parsed, and compared with ours (no GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nccl_tests_peer.py"
MIB = 1024**2


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("nccl_tests_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(size: int, count: int, typ: str, op: str, root: int, *modes: tuple) -> str:
    """One result line exactly as nccl-tests' common.cu prints it (TimeTest + BenchTime).

    printf's own formats, so the test reads like the C it mirrors (hence the noqa: UP031).
    """
    line = "%12li  %12li  %8s  %6s  %6s" % (size, count, typ, op, "%6i" % root)  # noqa: UP031
    for time_us, algbw, busbw, wrong in modes:
        time_str = ("%7.0f" if time_us >= 10000 else "%7.1f" if time_us >= 100 else "%7.2f") \
            % time_us
        if wrong is None:
            line += "  %7s  %6.2f  %6.2f  %5s" % (time_str, algbw, busbw, "N/A")  # noqa: UP031
        else:
            line += "  %7s  %6.2f  %6.2f  %5g" % (time_str, algbw, busbw, wrong)  # noqa: UP031
    return line


HEADER = """\
# nThread 1 nGpus 4 minBytes 67108864 maxBytes 134217728 step: 2(factor) warmup iters: 5 \
iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   4242 on         vm device  0 [0x18] NVIDIA H200
#  Rank  1 Group  0 Pid   4242 on         vm device  1 [0x2a] NVIDIA H200
#
#                                                              out-of-place                \
       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time\
   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)\
  (GB/s)  (GB/s)
"""
FOOTER = """\
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 322.5
#
"""


def test_parses_the_rows_of_a_table_between_comments_and_nccl_logs(peer) -> None:
    text = (HEADER
            + "vm:4242:4242 [0] NCCL INFO NCCL_NVLS_ENABLE set by environment to 0.\n"
            + _row(64 * MIB, 32 * MIB, "bfloat16", "sum", -1, (317.4, 211.43, 317.15, 0),
                   (316.9, 211.77, 317.65, 0)) + "\n"
            + _row(128 * MIB, 64 * MIB, "bfloat16", "sum", -1, (12345.6, 10.87, 16.31, 3),
                   (612.0, 219.31, 328.96, None)) + "\n"
            + FOOTER)
    rows = peer.parse_table(text)
    assert [r["size"] for r in rows] == [64 * MIB, 128 * MIB]
    first, second = rows
    assert (first["count"], first["type"], first["redop"], first["root"]) == \
        (32 * MIB, "bfloat16", "sum", -1)
    assert (first["oop_time_us"], first["oop_algbw"], first["oop_busbw"], first["oop_wrong"]) \
        == (317.4, 211.43, 317.15, 0)
    assert (first["ip_busbw"], first["ip_wrong"]) == (317.65, 0)
    # %7.0f above 10 ms, %5g for #wrong, N/A when the check is off.
    assert (second["oop_time_us"], second["oop_wrong"]) == (12346.0, 3)
    assert (second["ip_busbw"], second["ip_wrong"]) == (328.96, None)


def test_parses_older_and_in_place_only_layouts(peer) -> None:
    modes = ((300.0, 220.0, 330.0, 0), (301.0, 219.0, 328.5, 0))
    metrics = _row(0, 0, "", "", 0, *modes)[len(_row(0, 0, "", "", 0)):]
    no_root = "%12li  %12li  %8s  %6s" % (64 * MIB, 32 * MIB, "float", "sum") + metrics  # noqa: UP031
    no_label = "%12li  %12li  %8s" % (64 * MIB, 4 * MIB, "float") + metrics  # noqa: UP031
    ip_only = _row(64 * MIB, 32 * MIB, "bfloat16", "none", -1, (300.0, 220.0, 330.0, 0))
    rows = peer.parse_table("\n".join([no_root, no_label, ip_only]))
    assert [(r["redop"], r["root"], r["oop_busbw"], r["ip_busbw"]) for r in rows] == [
        ("sum", None, 330.0, 328.5), (None, None, 330.0, 328.5), ("none", -1, None, 330.0)]


def _ours(op: str, size: int, oop: float | None, ip: float) -> dict:
    return {"op": op, "size": size, "oop_busbw": oop, "ip_busbw": ip, "oop_wrong": None
            if oop is None else 0, "ip_wrong": 0}


def test_compares_like_with_like_and_checks_the_tolerance_from_64_mib(peer) -> None:
    def ref(size: int, oop: float, ip: float) -> dict:
        return {"size": size, "oop_busbw": oop, "ip_busbw": ip, "oop_wrong": 0, "ip_wrong": 0}

    nccl = {"all_reduce": [ref(32 * MIB, 290.0, 291.0), ref(64 * MIB, 320.0, 310.0)],
            "all_gather": [ref(64 * MIB, 264.0, 270.0), ref(128 * MIB, 290.0, 290.0)]}
    ours = [_ours("all_reduce", 32 * MIB, None, 250.0), _ours("all_reduce", 64 * MIB, None, 312.1),
            _ours("all_gather", 64 * MIB, 264.5, 262.0), _ours("all_gather", 128 * MIB, 300.0, 1.0)]
    rows = {(r["op"], r["size"]): r for r in peer.compare(nccl, ours)}
    # all_reduce: torch has no out-of-place, so in-place against in-place; below 64 MiB unchecked.
    small, big = rows[("all_reduce", 32 * MIB)], rows[("all_reduce", 64 * MIB)]
    assert (small["mode"], small["within"]) == ("ip", None)
    assert big["mode"] == "ip" and big["ratio"] == pytest.approx(312.1 / 310.0)
    assert big["within"] is True
    ag = rows[("all_gather", 64 * MIB)]
    assert (ag["mode"], ag["nccl_tests_oop_busbw"], ag["ours_oop_busbw"]) == ("oop", 264.0, 264.5)
    assert ag["within"] is True
    # 3.4% faster than nccl-tests is outside the band too: it points at a measuring difference.
    assert rows[("all_gather", 128 * MIB)]["within"] is False
    table = peer.markdown(list(rows.values()), 0.03)
    assert "| all_reduce | 64 MiB | 320.0 | 310.0 | - | 312.1 | 1.007 (ip) | yes |" in table
    assert "| all_gather | 128 MiB |" in table and "**no**" in table


def test_a_missing_tree_is_a_clear_error(peer, tmp_path: Path) -> None:
    with pytest.raises(peer.PeerError, match="no nccl-tests tree"):
        peer.build(tmp_path / "nowhere", tmp_path, ["all_reduce"], 1)
