"""Checking what we read back from our own files: one declarative schema per record.

Every JSON/YAML file hpctrain writes and later reads (checkpoint manifests, ``exit_info.json``,
the goodput ledger, pipeline state) may have been damaged, edited or planted by someone who can
write to the folder. Before anything acts on such a record it is checked against a schema:
types, ranges, finite numbers, required keys. A failure names the file, the field, the value
(``repr``, cut short, so control characters are shown, never emitted) and what was expected.

    LEDGER = Record({"runs": Int(0), "rate": Real(0.0, optional=True)})
    ledger = LEDGER.check(json.loads(text), where=path)   # raises BadRecord

Callers turn ``BadRecord`` into what the damage means for them (a damaged checkpoint is fallen
back past; a damaged ledger is set aside and a new one started).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.errors import HpctrainError
from hpctrain.shown import quoted

# The largest count a record may hold: integers above 2**53 do not survive a round trip through
# a float (JavaScript, many JSON tools) and no run reaches them; 10**30 is damage, not progress.
MAX_COUNT = 2**53
_MISSING = object()  # the "value" of a required key that is absent


class BadRecord(HpctrainError):
    """A file we wrote holds a value of the wrong type or out of range (damaged or edited)."""


class Field:
    """The rule for one value; ``optional`` fields may be absent, ``nullable`` ones null."""

    optional: bool = False
    nullable: bool = False

    def problem(self, value: Any, name: str) -> tuple[str, Any, str] | None:
        """None when ``value`` fits, else (field name, the bad value, what was expected)."""
        if value is None and self.nullable:
            return None
        return None if self.fits(value) else (name, value, self.expected())

    def check(self, data: Any, where: str | Path) -> Any:
        """``data`` when it fits this rule, else BadRecord naming the file, field and value."""
        bad = self.problem(data, "")
        if bad is None:
            return data
        name, value, expected = bad
        value_text = "(missing)" if value is _MISSING else quoted(value)
        raise BadRecord(f"{where}: {name or '(the whole file)'} = {value_text}",
                        expected=expected)

    def fits(self, value: Any) -> bool:
        """Whether ``value`` itself (not null) fits this rule."""
        raise NotImplementedError

    def expected(self) -> str:
        """What this rule accepts, in words."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Field):
    """An integer (not a bool) in ``[minimum, maximum]``."""

    minimum: int = 0
    maximum: int = MAX_COUNT
    optional: bool = False
    nullable: bool = False

    def fits(self, value: Any) -> bool:
        return (isinstance(value, int) and not isinstance(value, bool)
                and self.minimum <= value <= self.maximum)

    def expected(self) -> str:
        return f"an integer from {self.minimum} to {self.maximum}"


@dataclass(frozen=True)
class Real(Field):
    """A finite number (int or float, not a bool) in ``[minimum, maximum]``."""

    minimum: float = -math.inf
    maximum: float = math.inf
    optional: bool = False
    nullable: bool = False

    def fits(self, value: Any) -> bool:
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value) and self.minimum <= value <= self.maximum)

    def expected(self) -> str:
        low = "" if self.minimum == -math.inf else f" >= {self.minimum:g}"
        high = "" if self.maximum == math.inf else f" <= {self.maximum:g}"
        return "a finite number" + (low + (" and" if low and high else "") + high)


@dataclass(frozen=True)
class Str(Field):
    """A string of at most ``max_len`` characters, one of ``choices`` when given, matching
    ``pattern`` (described as ``what``) when given."""

    max_len: int = 4096
    choices: tuple[str, ...] = ()
    pattern: str = ""
    what: str = ""
    optional: bool = False
    nullable: bool = False

    def fits(self, value: Any) -> bool:
        return (isinstance(value, str) and len(value) <= self.max_len
                and (not self.choices or value in self.choices)
                and (not self.pattern or re.fullmatch(self.pattern, value) is not None))

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return self.what or f"a string of at most {self.max_len} characters"


@dataclass(frozen=True)
class Bool(Field):
    """true or false."""

    optional: bool = False
    nullable: bool = False

    def fits(self, value: Any) -> bool:
        return isinstance(value, bool)

    def expected(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class List(Field):
    """A list of ``item`` values, ``min_len`` to ``max_len`` long."""

    item: Field
    min_len: int = 0
    max_len: int = 1_000_000
    optional: bool = False
    nullable: bool = False

    def problem(self, value: Any, name: str) -> tuple[str, Any, str] | None:
        if value is None and self.nullable:
            return None
        if not (isinstance(value, list) and self.min_len <= len(value) <= self.max_len):
            return name, value, self.expected()
        for i, item in enumerate(value):
            bad = self.item.problem(item, f"{name}[{i}]")
            if bad:
                return bad
        return None

    def expected(self) -> str:
        size = (f"{self.min_len}" if self.min_len == self.max_len
                else f"{self.min_len} to {self.max_len}")
        return f"a list of {size} items, each {self.item.expected()}"


@dataclass(frozen=True)
class Record(Field):
    """A JSON object holding ``fields`` (required unless optional); other keys are allowed
    (newer versions add fields) unless ``closed``."""

    fields: Mapping[str, Field] = field(default_factory=dict)
    closed: bool = False
    optional: bool = False
    nullable: bool = False

    def problem(self, value: Any, name: str) -> tuple[str, Any, str] | None:
        if value is None and self.nullable:
            return None
        if not isinstance(value, dict):
            return name, value, "a JSON object"
        prefix = f"{name}." if name else ""
        for key, rule in self.fields.items():
            if key not in value:
                if not rule.optional:
                    return prefix + key, _MISSING, rule.expected()
                continue
            bad = rule.problem(value[key], prefix + key)
            if bad:
                return bad
        if self.closed:
            extra = sorted(set(value) - set(self.fields), key=str)
            if extra:
                return prefix + str(extra[0]), value[extra[0]], "no such field"
        return None

    def expected(self) -> str:
        return "an object with " + ", ".join(self.fields) if self.fields else "a JSON object"


@dataclass(frozen=True)
class Map(Field):
    """An object whose keys are free (``key`` checks them) and whose values all fit ``value``."""

    key: Str
    value: Field
    max_len: int = 1_000_000
    optional: bool = False
    nullable: bool = False

    def problem(self, value: Any, name: str) -> tuple[str, Any, str] | None:
        if value is None and self.nullable:
            return None
        if not (isinstance(value, dict) and len(value) <= self.max_len):
            return name, value, self.expected()
        for k, v in value.items():
            bad = self.key.problem(k, f"{name} key") or self.value.problem(v, f"{name}[{k!r}]")
            if bad:
                return bad
        return None

    def expected(self) -> str:
        return f"an object of {self.value.expected()}"


def too_large(data: Any, limit: int) -> bool:
    """Whether ``data`` (parsed JSON/YAML) has more than ``limit`` values once every shared
    node is counted each time it appears: YAML aliases make a few lines stand for billions of
    values, which anything that walks or serialises the tree then spends."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False
