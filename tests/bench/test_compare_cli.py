"""benchmarks/peers/compare.py without a GPU: its command line and the configs of its layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("given", [["--tag", "autocast"], ["--tag=-autocast"]])
def test_a_tag_is_taken_with_or_without_its_hyphen(compare, given: list[str]) -> None:
    args = compare.parser().parse_args(["--layouts", "8b-tp2", "--only", "hpctrain",
                                        "--set", "parallel.mixed_precision=autocast", *given])
    assert args.tag == "-autocast"
    assert args.set == ["parallel.mixed_precision=autocast"]


def test_no_tag_means_plain_layout_names(compare) -> None:
    args = compare.parser().parse_args(["--layouts", "8b-tp2", "8b-pp2", "--steps", "40"])
    assert args.tag == ""
    assert args.layouts == ["8b-tp2", "8b-pp2"]


def test_an_ab_of_both_sides_reaches_both_command_lines(compare, tmp_path: Path) -> None:
    """``--set`` goes to our overrides, ``--peer-arg`` to the end of torchtitan's argv."""
    flag = "--parallelism.enable_async_tensor_parallel"
    args = compare.parser().parse_args(["--layouts", "8b-tp2", "--set", "parallel.async_tp=true",
                                        f"--peer-arg={flag}", "--tag", "asynctp"])
    layout = compare.chosen_layout("8b-tp2", args)
    assert layout.overrides == [*compare.LAYOUTS["8b-tp2"].overrides, "parallel.async_tp=true"]
    assert layout.peer.argv(tmp_path)[-1] == flag
    assert flag not in compare.LAYOUTS["8b-tp2"].peer.argv(tmp_path)  # the table is untouched
    load_config(REPO / layout.config, layout.overrides)


def test_an_empty_tag_is_refused(compare, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        compare.parser().parse_args(["--layouts", "8b-tp2", "--tag=-"])
    assert "a tag needs a name" in capsys.readouterr().err


def test_every_layout_is_a_valid_config_for_its_gpus(compare) -> None:
    for name, layout in compare.LAYOUTS.items():
        cfg = load_config(REPO / layout.config, layout.overrides)
        par = cfg.parallel
        assert layout.gpus % (par.tp * par.pp) == 0, name
        assert cfg.model.size == layout.peer.size, name


def _chosen(compare, layout: str, *argv: str):
    return compare.chosen_layout(layout, compare.parser().parse_args(["--layouts", layout,
                                                                      *argv]))


def test_the_peer_follows_what_set_changes(compare) -> None:
    """``--set`` changes the peer's run as tuned.peer_run maps it; a --peer-arg saying the same
    is not given twice; with --only hpctrain the peer is left as it is."""
    never = "--parallelism.fsdp_reshard_after_forward=never"
    zero2 = _chosen(compare, "1b-fsdp4", "--set", "parallel.reshard_after_forward=false",
                    f"--peer-arg={never}")
    assert zero2.peer.extra.count(never) == 1
    fp8 = _chosen(compare, "8b-fsdp4", "--set", "train.precision=fp8")
    assert {"--model.converters=quantize.linear.float8",
            "--quantize.linear.float8.filter_fqns=output",
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"} <= set(
                fp8.peer.extra)
    one_gpu = _chosen(compare, "1b-1gpu", "--set", "train.precision=fp8")
    assert one_gpu.peer.extra == ["--model.converters=quantize.linear.float8",
                                  "--quantize.linear.float8.filter_fqns=output"]
    pure = _chosen(compare, "1b-1gpu", "--set", "train.master_weights=bf16")
    assert (compare.LAYOUTS["1b-1gpu"].peer.dtype, pure.peer.dtype) == ("float32", "bfloat16")
    # The layout's own choice stays: 8b TP4's peer runs pure bf16 already.
    tp4 = _chosen(compare, "8b-tp4", "--set", "train.master_weights=bf16")
    assert tp4.peer == compare.LAYOUTS["8b-tp4"].peer
    bf16rs = _chosen(compare, "1b-fsdp4", "--set", "parallel.reduce_precision=bf16")
    assert bf16rs.peer == compare.LAYOUTS["1b-fsdp4"].peer
    assert "ours reduces gradients in bf16, the peer in fp32" in bf16rs.note
    ours_only = _chosen(compare, "1b-fsdp4", "--only", "hpctrain", "--set",
                        "parallel.reshard_after_forward=false")
    assert ours_only.peer == compare.LAYOUTS["1b-fsdp4"].peer


def test_a_set_the_peer_cannot_follow_stops_before_any_run(compare) -> None:
    with pytest.raises(SystemExit) as e:
        _chosen(compare, "1b-1gpu", "--set", "train.precision=fp32")
    assert "the peer cannot follow --set train.precision=fp32" in str(e.value)
    assert "--only hpctrain" in str(e.value)


def test_the_ratio_is_the_median_of_same_call_pairs(compare) -> None:
    """Each pair's ratio is ours over the peer's run of the same pair, and the table shows their
    median: the peer's best run against our worst is no pair."""
    def row(side: str, pair: int, rate: float) -> dict:
        return {"side": side, "layout": "1b-1gpu", "pair": pair, "tag": "",
                "tokens_per_s_per_gpu": rate, "mfu_pct": 40.0, "peak_mem_gb": 10.0,
                "peak_mem_gib": 9.0}
    rows = [row("hpctrain", 0, 110.0), row("torchtitan", 0, 100.0),
            row("torchtitan", 1, 120.0), row("hpctrain", 1, 126.0),
            row("hpctrain", 2, 90.0), row("torchtitan", 2, 75.0),
            {"side": "torchtitan", "layout": "1b-1gpu", "pair": 3, "error": "OOM"}]
    ours = [r for r in rows if r["side"] == "hpctrain"]
    theirs = [r for r in rows if r["side"] == "torchtitan"]
    assert compare.pair_ratios(ours, theirs) == pytest.approx([1.10, 1.05, 1.20])
    line = compare.table(rows, "cpu", {}).splitlines()[-1]
    assert "| 1.10x | 1.100 / 1.050 / 1.200 |" in line
