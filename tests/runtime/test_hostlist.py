"""Slurm hostlist expansion."""

from __future__ import annotations

import pytest

from hpctrain.errors import RuntimeEnvError
from hpctrain.runtime.hostlist import expand_hostlist


def test_ranges_and_lists_across_hosts() -> None:
    assert expand_hostlist("node[001-003,007],gpu-a[1-2]") == [
        "node001",
        "node002",
        "node003",
        "node007",
        "gpu-a1",
        "gpu-a2",
    ]


def test_plain_names() -> None:
    assert expand_hostlist("login1") == ["login1"]
    assert expand_hostlist("a,b,c") == ["a", "b", "c"]


def test_padding_follows_start_bound() -> None:
    assert expand_hostlist("n[08-11]") == ["n08", "n09", "n10", "n11"]
    assert expand_hostlist("n[9-10]") == ["n9", "n10"]


def test_several_groups_expand_leftmost_slowest() -> None:
    assert expand_hostlist("rack[1-2]-n[01-02]") == [
        "rack1-n01",
        "rack1-n02",
        "rack2-n01",
        "rack2-n02",
    ]


@pytest.mark.parametrize(
    "spec",
    ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "node[[1]]", "a,,b", "", "node[]"],
)
def test_bad_specs_raise_naming_the_spec(spec: str) -> None:
    with pytest.raises(RuntimeEnvError) as info:
        expand_hostlist(spec)
    assert repr(spec) in str(info.value)


def test_reversed_range_says_so() -> None:
    with pytest.raises(RuntimeEnvError, match="reversed range"):
        expand_hostlist("node[5-2]")
