"""The job configuration: one dataclass per component, composed here, loaded from YAML + overrides.

Each component keeps its own config dataclass next to its code (``models/config.py``,
``train/config.py``, ...). This module composes them into :class:`JobConfig` and owns the one
generic loader: it walks the dataclass type hints, so every key and value is checked against the
annotation and errors name the key, the valid choices and a hint.

    cfg = load_config("configs/demo.yaml", ["train.steps=100", "parallel.strategy=fsdp"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import stat
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.data.config import DataConfig
from hpctrain.errors import ConfigError
from hpctrain.models.config import ModelConfig
from hpctrain.models.registry import count_params
from hpctrain.observe.config import MetricsConfig
from hpctrain.observe.profile import ProfileConfig
from hpctrain.observe.track import TrackConfig
from hpctrain.parallel.config import ParallelConfig
from hpctrain.records import too_large
from hpctrain.runtime.config import RunConfig
from hpctrain.runtime.watchdog import WatchdogConfig
from hpctrain.train.config import OptimConfig, TrainConfig
from hpctrain.train.guard import GuardConfig
from hpctrain.train.preemption import PreemptConfig


@dataclasses.dataclass
class JobConfig:
    """Everything one training job needs; each field is one component's section in the YAML."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    preempt: PreemptConfig = dataclasses.field(default_factory=PreemptConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)
    track: TrackConfig = dataclasses.field(default_factory=TrackConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    # A user's own model, data and loss (hpctrain/task.py): ``my_task.py[:fn]`` or
    # ``package.module[:fn]``; unset: the built-in model of the ``model`` section.
    task: str | None = None
    # Keyword arguments for the task's factory, e.g. a built-in task's settings
    # (``task: hpctrain.tasks.images:classifier`` with ``task_args: {model: resnet50, ...}``).
    task_args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        """Check each section, settle the model's vocabulary from the data (the one value a
        section takes from another, see :meth:`settle_vocab`), then the rules that span
        sections."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        if self.task_args and not self.task:
            raise ConfigError("task_args is set but task is not",
                              expected="task_args only beside a task: that names its factory",
                              hint="add e.g. task: hpctrain.tasks.images:classifier, or drop "
                              "task_args")
        self.settle_vocab()
        args = self.model.resolve()
        self.parallel.check_precision(self.train.precision,
                                      count_params(args, include_embedding=True),
                                      self.train.master_weights)
        # A family's shape may set no limit (hpctrain.models.spec).
        max_seq_len = getattr(args, "max_seq_len", None)
        if max_seq_len is not None and self.data.seq_len > max_seq_len:
            raise ConfigError(
                f"data.seq_len = {self.data.seq_len} exceeds the model's max_seq_len "
                f"({max_seq_len})",
                hint=f"set model.max_seq_len={self.data.seq_len} or shorten data.seq_len",
            )
        vocab, data_vocab = args.vocab_size, self.data.vocab_size
        if data_vocab > vocab:
            fixed_by = (f"the pretrained model {self.model.init_from!r}" if self.model.init_from
                        else "model.vocab_size" if self.model.vocab_size is not None
                        else f"the {self.model.size!r} preset")
            if self.model.init_from:
                hint = f"prepare the data with that model's tokenizer ({vocab} ids)"
            elif self.data.source in ("shards", "mix"):
                hint = (f"remove model.vocab_size to follow the data's manifest ({data_vocab} "
                        f"ids), or set model.vocab_size >= {data_vocab}")
            else:
                hint = f"set model.vocab_size >= {data_vocab}"
            raise ConfigError(
                f"data vocabulary ({data_vocab} ids) is larger than the model's ({vocab}, from "
                f"{fixed_by})",
                expected="a model vocabulary that holds every token id of the data",
                hint=hint,
            )

    def settle_vocab(self) -> None:
        """Give the model the vocabulary of the data's manifest unless the config fixes one.

        With ``data.source`` shards or mix and neither ``model.vocab_size`` nor
        ``model.init_from`` set, ``model.vocab_size`` becomes the manifest's ``vocab_size`` (the
        largest of a mixture's). The value is written into the config, so the run's
        ``config.yaml`` and its checkpoints record the vocabulary the model was built with, and
        a resume against data prepared with another vocabulary is refused as another model.
        A byte-level source (stdlib) has no manifest: the preset's vocabulary stays.
        """
        if (self.model.vocab_size is None and not self.model.init_from
                and self.data.source in ("shards", "mix")):
            self.model.vocab_size = self.data.vocab_size


def load_config(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Read a YAML file (or start from defaults when None), apply ``a.b=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
        _unset_recorded_grad_accum(Path(path), raw)
    for item in overrides:
        apply_override(raw, item)
    cfg = from_dict(JobConfig, raw)
    cfg.validate()
    return cfg


def _unset_recorded_grad_accum(path: Path, raw: dict[str, Any]) -> None:
    """In a run's recorded config (``RUN/config/config.yaml``) written before grad_accum could
    be left unset, read its ``grad_accum: 1`` beside ``global_batch_tokens`` as unset.

    Such a record dumped the old default, 1, which then meant "derive it": read as given, it
    would now fix the micro-batch or be refused, and the run would not resume from its own
    record. The record is told by its ``auto.yaml`` (always written beside a batch in tokens),
    which since then also holds what the config held (``given``): one with it is read as is,
    a 1 there being the user's."""
    train = raw.get("train")
    if (path.name != "config.yaml" or path.parent.name != "config" or not isinstance(train, dict)
            or train.get("global_batch_tokens") is None or train.get("grad_accum") != 1):
        return
    try:
        # The name plan.auto.AUTO_FILE (plan imports this module, not the other way).
        auto = yaml.safe_load((path.parent / "auto.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # not a run's record: a config the user keeps in a folder named config/
    if isinstance(auto, dict) and isinstance(auto.get("values"), dict) and "given" not in auto:
        train["grad_accum"] = None


# Non-regular files a config path may name (``/dev/stdin`` is a pipe or a terminal).
_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))
# Configs are a few kB; anything this large is another file, and would be parsed whole.
MAX_CONFIG_BYTES = 1 << 20
# Values once YAML aliases are expanded: real configs hold a few hundred.
MAX_CONFIG_VALUES = 100_000


def _read_yaml(p: Path) -> dict[str, Any]:
    """The mapping a config file holds, or ConfigError saying why it cannot be read."""
    try:
        st = os.stat(p)  # not opened yet: opening a FIFO would block until a writer comes
    except FileNotFoundError:
        what = ("is a symbolic link to a file that does not exist" if os.path.islink(p)
                else "does not exist")
        raise ConfigError(
            f"config file {str(p)!r} {what}",
            expected="a YAML file such as configs/demo.yaml",
            hint="run from the repository root or pass an absolute path",
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"config file {str(p)!r} is a directory",
            expected="a YAML file",
            hint=f"pass one of the YAML files inside it, e.g. {p / 'demo.yaml'} "
            "(the shipped ones are in configs/)",
        )
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _SPECIAL if test(st.st_mode)), "a special file")
        raise ConfigError(
            f"config file {str(p)!r} is {kind}, not a regular file",
            expected="a YAML file (it is read again by restarts and recorded in the run)",
            hint="write the config to a file first, e.g. `cat > my.yaml`, and pass that",
        )
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {str(p)!r} is {st.st_size:,} bytes",
            expected=f"a YAML config of at most {MAX_CONFIG_BYTES:,} bytes",
            hint="check that this is the config and not a data file",
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: {e.reason})",
            expected="a YAML file encoded as UTF-8",
            hint="re-save it as UTF-8 (iconv -f latin1 -t utf-8), or check that this is the "
            "config and not another file",
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if too_large(raw, MAX_CONFIG_VALUES):
        raise ConfigError(
            f"config file {str(p)!r} expands to more than {MAX_CONFIG_VALUES:,} values",
            expected="a config without YAML aliases (*name) that multiply its size",
            hint="write the values out instead of nesting aliases")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {str(p)!r} holds a {type(raw).__name__}",
            expected="a mapping of sections (run, model, data, train, ...)",
        )
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``section.key=value`` in a nested dict; the value is parsed as YAML (``true``, ``3``)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"override {item!r} is not of the form key=value",
            expected="dotted.key=value, e.g. train.steps=100",
        )
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        node[parts[-1]] = value
    if too_large(node[parts[-1]], MAX_CONFIG_VALUES):
        raise ConfigError(f"override {key.strip()}= expands to more than "
                          f"{MAX_CONFIG_VALUES:,} values",
                          expected="a value without YAML aliases (*name) that multiply it")


def from_dict(cls: type, raw: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a plain dict, checking every key and value against its type."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where or 'config'} must be a mapping, got {raw!r}",
            expected=f"keys of {cls.__name__}: {', '.join(_field_names(cls))}",
        )
    hints = get_type_hints(cls)
    names = _field_names(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            raise ConfigError(
                f"unknown config key {path!r}",
                expected=f"one of: {', '.join(names)}",
                hint=f"did you mean {close[0]!r}?" if close else "check the spelling and section",
            )
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, ready for YAML."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML text (written into the run directory)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error says more than "wrong type"
            try:
                return _coerce(options[0], value, path)
            except ConfigError as e:
                if get_origin(options[0]) in (list, tuple) or dataclasses.is_dataclass(options[0]):
                    raise  # an error inside the structure: "or null" would not be the fix
                raise ConfigError(e.what, expected=f"{e.expected or 'a value'} or null",
                                  hint=e.hint) from None
        errors = []
        for arg in options:
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(e.expected or e.what)
        raise ConfigError(f"{path} = {value!r} has the wrong type", expected=" or ".join(errors))
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"{path} = {value!r} is not a valid choice",
                expected=f"one of: {', '.join(repr(c) for c in choices)}",
                hint="YAML reads on/off/yes/no as booleans: quote the value"
                if isinstance(value, bool) else None,
            )
        return value
    if origin is dict:
        key_tp, value_tp = get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r} is not a mapping",
                              expected="a YAML mapping of name: value")
        return {_coerce(key_tp, k, path): _coerce(value_tp, v, f"{path}.{k}")
                for k, v in value.items()}
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} = {value!r} is not a list", expected="a YAML list")
        items = [_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {value!r} is not a boolean", expected="true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} = {value!r} is not an integer", expected="an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads 1e-3, with no dot, as a string.
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} = {value!r} is not a number", expected="a number")
        if not math.isfinite(value):
            # NaN passes every comparison a validate() makes (nan <= 0 is False), so it would
            # slip through and, e.g., turn gradient clipping off without a word.
            raise ConfigError(f"{path} = {value!r} is not a finite number",
                              expected="a finite number (NaN and infinity are refused)",
                              hint="YAML reads .nan, .inf and 1e999 as non-finite floats")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {value!r} is not a string", expected="a string")
        return value
    raise TypeError(f"config type {tp!r} at {path} is not supported by the loader")

