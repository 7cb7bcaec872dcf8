"""hpctrain profile: GPU time by kind, idle time and exposed communication from Chrome traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain.observe.trace_summary import (
    TraceError,
    find_traces,
    kind_of,
    markdown,
    summarise_trace,
    union_length,
)


def _kernel(name: str, ts: float, dur: float, stream: int = 7, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream}


def _trace(tmp_path: Path, events: list[dict], folder: str = "step-000020-000021") -> Path:
    path = tmp_path / "run" / "profiles" / folder / "rank-000.trace.json"
    path.parent.mkdir(parents=True)
    cpu = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -50, "dur": 500, "pid": 1,
           "tid": 1}  # CPU events are not GPU time and do not stretch the span
    path.write_text(json.dumps({"traceEvents": [cpu, *events]}))
    return path


def test_a_known_timeline_is_accounted_to_the_microsecond(tmp_path: Path) -> None:
    path = _trace(tmp_path, [
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 10),
        _kernel("ncclDevKernel_AllGather_RING_LL", 5, 10, stream=20),   # 5 us hidden, 5 exposed
        _kernel("triton_per_fused_add_mul_rsqrt_0", 20, 5),
        _kernel("Memcpy DtoH (Device -> Pinned)", 30, 1, cat="gpu_memcpy"),
        _kernel("void multi_tensor_apply_kernel<FusedAdam...>", 31, 2),
        _kernel("flash_fwd_kernel", 40, 4),
        _kernel("void at::native::vectorized_elementwise_kernel", 44, 1),
    ])
    s = summarise_trace(path, steps=2)
    assert s.span_us == 45 and s.busy_us == 10 + 5 + 5 + 1 + 2 + 4 + 1  # [0,15] [20,25] ...
    assert s.idle_us == 45 - 28
    assert s.comm_us == 10 and s.comm_exposed_us == 5
    assert s.kinds == {"gemm": 10, "attention": 4, "communication": 10, "optimizer": 2,
                       "fused pointwise (Triton)": 5, "memcpy/memset": 1, "other": 1}
    table = markdown([s])
    assert "| step-000020-000021/rank-000.trace.json | 0.0 | 37.8% |" in table  # idle 17/45
    assert "11.1%" in table  # 5 us of exposed communication in 45
    assert s.top[0][0].startswith(("sm90_xmma", "ncclDev"))


def test_kinds_follow_the_kernel_names() -> None:
    assert kind_of("ampere_bf16_s16816gemm_bf16_128x128", "kernel") == "gemm"
    assert kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "kernel") == "gemm"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "kernel") == "attention"
    assert kind_of("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "kernel") == "communication"
    assert kind_of("triton_red_fused__to_copy_mul_sum_3", "kernel") == "fused pointwise (Triton)"
    assert kind_of("Memset (Device)", "gpu_memset") == "memcpy/memset"
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4


def _profile_cli(capsys: pytest.CaptureFixture, path: str) -> tuple[int, str, str]:
    """``hpctrain profile PATH`` in this process (no interpreter to start and torch to import):
    (exit code, stdout, stderr)."""
    from hpctrain.cli import main

    try:
        main(["profile", path])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


# main()'s elastic @record cannot enable the fault handler on captured stderr.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_run_directory_lists_every_rank_and_the_steps_per_profile(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _trace(tmp_path, [_kernel("gemm", 0, 2000)])
    (path.parent / "rank-001.trace.json").write_text(path.read_text())
    found = find_traces(tmp_path / "run")
    assert [(p.name, n) for p, n in found] == [("rank-000.trace.json", 2),
                                              ("rank-001.trace.json", 2)]
    code, out, err = _profile_cli(capsys, str(tmp_path / "run"))
    assert code == 0, err
    assert "rank-001.trace.json | 1.0 |" in out  # 2 ms over 2 steps


# main()'s elastic @record cannot enable the fault handler on captured stderr.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_a_cpu_trace_or_a_run_without_profiles_is_refused_with_a_hint(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "cpu.trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_chrome_trace(str(trace))
    with pytest.raises(TraceError, match="no GPU kernels"):
        summarise_trace(trace)
    code, _, err = _profile_cli(capsys, str(tmp_path))
    assert code == 2 and "no profiler traces" in err
    assert "profile.steps" in err
    (tmp_path / "bad.trace.json").write_text("{not json")
    with pytest.raises(TraceError, match="cannot read"):
        summarise_trace(tmp_path / "bad.trace.json")


def _launch(correlation: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 3,
            "pid": 1, "tid": 1, "args": {"correlation": correlation}}


def test_idle_gaps_say_whether_the_gpu_waited_for_a_launch(tmp_path: Path) -> None:
    """Three gaps: one the CPU closed late (launched 6 us into a 10 us gap), one whose kernel
    was queued long before (a wait on something else), one with no launch in the trace."""
    def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
        return {**_kernel(name, ts, dur), "args": {"correlation": corr}}

    path = _trace(tmp_path, [
        kernel("gemm_a", 100, 10, 1),                 # busy 100-110
        kernel("triton_b", 120, 5, 2),                # gap 110-120, launched at 116
        kernel("nccl_c", 125, 5, 3),
        kernel("gemm_d", 131, 4, 4),                  # gap 130-131, launched at 50
        _kernel("Memcpy HtoD", 160, 2, cat="gpu_memcpy"),  # gap 135-160, no correlation
        _launch(1, 90), _launch(2, 116), _launch(3, 118), _launch(4, 50),
    ], folder="step-000005-000005")
    s = summarise_trace(path, steps=1)
    assert s.idle_us == 10 + 1 + 25 and s.n_gaps == 3
    assert [(g.at_us, g.length_us, g.before, g.after) for g in s.gaps] == [
        (35, 25, "gemm_d", "Memcpy HtoD"), (10, 10, "gemm_a", "triton_b"),
        (30, 1, "nccl_c", "gemm_d")]
    assert [g.launch_lag_us for g in s.gaps] == [None, 6, -80]
    assert s.idle_launch_us == 6  # only the first 6 us of the 10 us gap waited for the CPU
    text = markdown([s])
    assert "0.04 ms a step in 3 gaps; 17% of it before the CPU had launched" in text
    assert "- 0.010 ms at 0.0 ms, after gemm_a, before triton_b (launched +0.006 ms" in text
    assert "(launch not in the trace)" in text
