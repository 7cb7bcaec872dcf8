"""The job config loader: shipped configs, dotted overrides, typed errors with hints, the CLI.

Named test_job_config.py, not test_config.py: tests/ has no __init__.py files, so a second
``test_config`` module next to tests/models/test_config.py fails collection ("import file
mismatch").
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from hpctrain.config import JobConfig, apply_override, dump_yaml, from_dict, load_config
from hpctrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _error(overrides: list[str], path: Path | None = ROOT / "configs" / "demo.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


# -- shipped configs ------------------------------------------------------------------------


def test_configs_dir_is_not_empty() -> None:
    assert {p.name for p in CONFIGS} >= {"demo.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_round_trips(path: Path) -> None:
    cfg = load_config(path)
    cfg.validate()
    raw = yaml.safe_load(path.read_text())
    # Every value the file sets is what the loaded config holds.
    for section, values in raw.items():
        held = getattr(cfg, section)
        if isinstance(held, str | dict):  # task: and task_args: are values, not sections
            assert held == values, section
            continue
        for key, value in values.items():
            assert getattr(held, key) == value, f"{section}.{key}"
    again = from_dict(JobConfig, yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg
    again.validate()


def test_demo_values() -> None:
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.run.name == "demo"
    assert cfg.run.device == "cpu"
    assert cfg.model.size == "tiny"
    assert cfg.train.steps == 60
    assert cfg.optim.lr == pytest.approx(2.0e-3)
    assert isinstance(cfg.optim.lr, float)
    assert cfg.parallel.strategy == "ddp"
    # Keys the file leaves out keep their dataclass defaults.
    assert cfg.train.grad_accum == 1
    assert cfg.optim.weight_decay == 0.1


def test_no_file_gives_defaults() -> None:
    expected = JobConfig()
    expected.validate()  # fills in the defaults validation resolves (the model family)
    assert load_config(None) == expected


# -- overrides -------------------------------------------------------------------------------


def test_override_int_bool_float() -> None:
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["train.steps=7", "parallel.compile=true", "optim.lr=0.001", "train.grad_clip=2"],
    )
    assert cfg.train.steps == 7
    assert cfg.parallel.compile is True
    assert cfg.optim.lr == 0.001
    # An int given for a float field becomes a float.
    assert cfg.train.grad_clip == 2.0
    assert isinstance(cfg.train.grad_clip, float)


def test_override_later_wins_and_value_may_contain_equals() -> None:
    cfg = load_config(None, ["train.steps=7", "train.steps=9", "run.name=a=b"])
    assert cfg.train.steps == 9
    assert cfg.run.name == "a=b"


def test_override_float_in_exponent_notation() -> None:
    cfg = load_config(None, ["optim.lr=1e-3"])
    assert cfg.optim.lr == 0.001


def test_exponent_float_with_dot_is_accepted() -> None:
    assert load_config(None, ["optim.lr=1.0e-3"]).optim.lr == 0.001


def test_override_creates_missing_section() -> None:
    raw: dict = {}
    apply_override(raw, "model.n_layers=2")
    apply_override(raw, "a.b.c=x")
    assert raw == {"model": {"n_layers": 2}, "a": {"b": {"c": "x"}}}


def test_override_through_a_value_is_refused() -> None:
    err = _error(["train.steps.x=3"])
    assert "train.steps.x=3" in err.what
    assert "'steps' is a value, not a section" in err.what


@pytest.mark.parametrize("item", ["train.steps", "=3", " =3", ""])
def test_malformed_override(item: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_override({}, item)
    assert "is not of the form key=value" in info.value.what
    assert info.value.expected == "dotted.key=value, e.g. train.steps=100"


def test_unknown_nested_section() -> None:
    err = _error(["trian.steps=3"])
    assert err.what == "unknown config key 'trian'"
    assert err.expected == ("one of: run, model, data, train, optim, parallel, metrics, "
                            "checkpoint, preempt, watchdog, guard, track, profile, task, task_args")
    assert err.hint == "did you mean 'train'?"


def test_unknown_section_without_close_match() -> None:
    err = _error(["zzz.bar=1"])
    assert err.what == "unknown config key 'zzz'"
    assert err.hint == "check the spelling and section"


def test_unknown_key_names_full_path_and_suggests() -> None:
    err = _error(["train.stepz=3"])
    assert err.what == "unknown config key 'train.stepz'"
    assert "steps" in err.expected and "micro_batch" in err.expected
    assert err.hint == "did you mean 'steps'?"
    assert err.exit_code == 2
    assert "HINT: did you mean 'steps'?" in str(err)


@pytest.mark.parametrize(
    ("item", "what", "expected"),
    [
        ("train.steps=abc", "train.steps = 'abc' is not an integer", "an integer"),
        ("train.steps=1.5", "train.steps = 1.5 is not an integer", "an integer"),
        # bool is a subclass of int, but true is not a step count.
        ("train.steps=true", "train.steps = True is not an integer", "an integer"),
        ("train.deterministic=maybe", "train.deterministic = 'maybe' is not a boolean",
         "true or false"),
        ("train.deterministic=1", "train.deterministic = 1 is not a boolean", "true or false"),
        ("optim.lr=fast", "optim.lr = 'fast' is not a number", "a number"),
        ("run.name=3", "run.name = 3 is not a string", "a string"),
        ("metrics.peak_tflops=abc", "metrics.peak_tflops = 'abc' is not a number",
         "a number or null"),
    ],
)
def test_wrong_type_names_key_and_type(item: str, what: str, expected: str) -> None:
    err = _error([item])
    assert err.what == what
    assert err.expected == expected


def test_yaml_11_booleans_are_accepted() -> None:
    # PyYAML's safe_load follows YAML 1.1, where yes/no/on/off are booleans.
    assert load_config(None, ["train.deterministic=yes"]).train.deterministic is True
    assert load_config(None, ["parallel.compile=off"]).parallel.compile is False


def test_optional_field_accepts_null_and_number() -> None:
    assert load_config(None, ["metrics.peak_tflops=null"]).metrics.peak_tflops is None
    assert load_config(None, ["metrics.peak_tflops=312"]).metrics.peak_tflops == 312.0


def test_literal_lists_choices() -> None:
    err = _error(["parallel.strategy=zero3"])
    assert err.what == "parallel.strategy = 'zero3' is not a valid choice"
    assert err.expected == "one of: 'none', 'ddp', 'fsdp', 'auto'"


def test_section_must_be_mapping() -> None:
    err = _error(["train=3"])
    assert err.what == "train must be a mapping, got 3"
    assert "steps" in err.expected


# -- files -----------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    err = _error([], tmp_path / "nope.yaml")
    assert "does not exist" in err.what and "nope.yaml" in err.what
    assert err.hint == "run from the repository root or pass an absolute path"


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    assert "is a directory" in _error([], tmp_path).what


def test_non_mapping_yaml(tmp_path: Path) -> None:
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    err = _error([], p)
    assert "holds a list" in err.what
    assert err.expected.startswith("a mapping of sections")


def test_invalid_yaml(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("train: [1, 2\n")
    assert "is not valid YAML" in _error([], p).what


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    expected = JobConfig()
    expected.validate()
    assert load_config(p) == expected


def test_unknown_key_in_file(tmp_path: Path) -> None:
    p = tmp_path / "typo.yaml"
    p.write_text("optim:\n  warmup: 10\n")
    err = _error([], p)
    assert err.what == "unknown config key 'optim.warmup'"
    assert err.hint == "did you mean 'warmup_steps'?"


def test_override_applies_on_top_of_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 5\n  micro_batch: 3\n")
    cfg = load_config(p, ["train.steps=6"])
    assert (cfg.train.steps, cfg.train.micro_batch) == (6, 3)


# -- round trip ------------------------------------------------------------------------------


def test_round_trip_with_overrides() -> None:
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["model.n_layers=2", "model.rope_theta=500000", "metrics.peak_tflops=100.5",
         "optim.eps=1.0e-12", "optim.scale_lr=linear"],
    )
    text = dump_yaml(cfg)
    back = from_dict(JobConfig, yaml.safe_load(text))
    assert back == cfg
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)
    # Section order follows JobConfig, so the written file reads top to bottom like the code.
    assert list(yaml.safe_load(text)) == ["run", "model", "data", "train", "optim", "parallel",
                                          "metrics", "checkpoint", "preempt", "watchdog",
                                          "guard", "track", "profile", "task", "task_args"]


# -- cross-section and section checks ----------------------------------------------------------


def test_seq_len_beyond_model_max() -> None:
    err = _error(["data.seq_len=4096"])  # tiny: max_seq_len 2048
    assert err.what == "data.seq_len = 4096 exceeds the model's max_seq_len (2048)"
    assert err.hint == "set model.max_seq_len=4096 or shorten data.seq_len"
    load_config(ROOT / "configs" / "demo.yaml", ["data.seq_len=4096", "model.max_seq_len=4096"])


def test_seq_len_equal_to_model_max_is_fine() -> None:
    assert load_config(None, ["data.seq_len=2048"]).data.seq_len == 2048


def test_model_vocab_smaller_than_data_vocab() -> None:
    err = _error(["model.vocab_size=100"])
    assert err.what == ("data vocabulary (256 ids) is larger than the model's (100, from "
                        "model.vocab_size)")
    assert err.hint == "set model.vocab_size >= 256"
    assert load_config(None, ["model.vocab_size=256"]).model.vocab_size == 256


@pytest.mark.parametrize(
    ("item", "fragment", "hint"),
    [
        ("model.size=huge", "model.size='huge' is not a known model size",
         "pick a preset and override single fields (e.g. model.n_layers) if needed"),
        ("model.n_heads=3", "model.dim=256 is not divisible by model.n_heads=3",
         "change dim or n_heads so that dim % n_heads == 0"),
        ("train.grad_clip=-1", "train.grad_clip = -1.0 must be >= 0", "0 disables clipping"),
        ("parallel.ac_every=0", None, None),
        ("run.name=a/b", "run.name = 'a/b' is not a plain directory name", None),
        ("train.micro_batch=0", "train.micro_batch = 0 must be >= 1", None),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio = 1.5 must lie in [0, 1]", None),
        ("data.seq_len=1", "data.seq_len = 1 must be >= 2", None),
    ],
)
def test_section_validation(item: str, fragment: str | None, hint: str | None) -> None:
    if fragment is None:  # ac_every only matters with every_k
        load_config(None, [item])
        err = _error([item, "parallel.activation_checkpointing=every_k"])
        assert err.what == "parallel.ac_every = 0 must be >= 1"
        assert err.hint == "ac_every=1 is the same as activation_checkpointing=full"
        return
    err = _error([item])
    assert err.what == fragment
    assert err.hint == hint


def test_backend_nccl_on_cpu() -> None:
    err = _error(["run.backend=nccl"])  # demo.yaml sets run.device: cpu
    assert err.hint == "use run.backend=gloo (or auto) on CPU"


# -- CLI -------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["config", *args], timeout=60)


def test_cli_config_bad_key_exits_2_without_traceback() -> None:
    proc = _cli("configs/demo.yaml", "train.stepz=3")
    assert proc.returncode == 2
    assert "train.stepz" in proc.stderr
    assert "did you mean 'steps'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


# main()'s elastic @record cannot enable the fault handler on captured stderr.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_cli_config_prints_resolved_yaml(capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.cli import main

    # In this process: the subprocess above already checks the console script's exit path.
    monkeypatch.chdir(ROOT)
    main(["config", "configs/demo.yaml", "train.steps=5"])
    stdout = capsys.readouterr().out
    assert "  steps: 5\n" in stdout
    printed = yaml.safe_load(stdout)
    assert printed["train"]["steps"] == 5
    assert printed["run"]["name"] == "demo"
    assert from_dict(JobConfig, printed) == load_config(
        ROOT / "configs" / "demo.yaml", ["train.steps=5"]
    )


def test_list_of_dataclasses_is_coerced_item_by_item(tmp_path: Path) -> None:
    from hpctrain.config import _coerce
    from hpctrain.data.config import MixSource

    got = _coerce(list[MixSource] | None, [{"path": "a", "weight": 2}, {"path": "b"}], "data.mix")
    assert got == [MixSource("a", 2.0), MixSource("b", 1.0)]
    assert _coerce(list[MixSource] | None, None, "data.mix") is None
    with pytest.raises(ConfigError, match="data.mix"):
        _coerce(list[MixSource] | None, [{"path": "a", "weight": "heavy"}], "data.mix")
