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
