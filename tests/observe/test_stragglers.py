"""The live straggler judge: named after N slow windows in a row, once per streak, with host."""

from __future__ import annotations

from hpctrain.observe.stragglers import RankTimes, StragglerDetector

HOSTS = ["a", "a", "b", "b"]


def _window(own: list[float], step_s: float = 1.0) -> list[RankTimes]:
    return [RankTimes(own=o, step=step_s) for o in own]


def test_slow_rank_is_named_after_the_windows_with_its_host() -> None:
    judge = StragglerDetector(HOSTS, threshold=0.1, windows=3)
    slow = [0.2, 0.21, 0.5, 0.2]  # rank 2 is 0.29 s slower than the median of a 1 s step
    assert judge.update(1, _window(slow)) == []
    assert judge.update(2, _window(slow)) == []
    (event,) = judge.update(3, _window(slow))
    assert event["event"] == "straggler" and event["step"] == 3
    assert event["straggler_rank"] == 2 and event["straggler_host"] == "b"
    assert abs(event["slower_by"] - 0.295) < 1e-9 and event["windows"] == 3
    assert judge.update(4, _window(slow)) == []  # once per streak
    (back,) = judge.update(5, _window([0.2] * 4))
    assert back == {"event": "straggler_recovered", "step": 5, "straggler_rank": 2,
                    "straggler_host": "b"}


def test_a_streak_broken_by_one_normal_window_starts_again() -> None:
    judge = StragglerDetector(HOSTS, threshold=0.1, windows=3)
    slow, normal = [0.2, 0.2, 0.5, 0.2], [0.2] * 4
    for step, times in enumerate([slow, slow, normal, slow, slow], start=1):
        assert judge.update(step, _window(times)) == []
    assert [e["straggler_rank"] for e in judge.update(6, _window(slow))] == [2]


def test_within_the_threshold_nobody_is_named() -> None:
    judge = StragglerDetector(HOSTS, threshold=0.1, windows=1)
    # 9% of the step above the median: noise, not a straggler. Faster ranks never are.
    assert judge.update(1, _window([0.2, 0.29, 0.2, 0.0])) == []


def test_two_ranks_name_the_slow_one_only() -> None:
    judge = StragglerDetector(["x", "y"], threshold=0.1, windows=1)
    (event,) = judge.update(1, _window([0.1, 0.4], step_s=0.5))
    assert event["straggler_rank"] == 1 and event["straggler_host"] == "y"


def test_one_rank_or_no_step_time_judges_nothing() -> None:
    assert StragglerDetector(["x"], 0.1, 1).update(1, _window([5.0])) == []
    assert StragglerDetector(HOSTS, 0.1, 1).update(1, _window([0, 0, 9, 0], step_s=0.0)) == []
