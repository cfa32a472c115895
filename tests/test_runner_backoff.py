"""The runner's polling backoff (service/runner/backoff.py), stepped with a fake clock."""

from __future__ import annotations

from meridian.service.runner.backoff import Backoff


def test_an_unchanging_answer_is_asked_for_less_and_less_often_up_to_the_cap():
    now = [0.0]
    b = Backoff(initial_s=1.0, max_s=8.0, clock=lambda: now[0])
    asked_at = []
    while now[0] < 40.0:
        if b.due("r1"):
            asked_at.append(now[0])
            b.unchanged("r1")
        now[0] += 0.5  # the runner's tick
    gaps = [round(b - a, 1) for a, b in zip(asked_at, asked_at[1:], strict=False)]
    assert gaps[:4] == [1.0, 2.0, 4.0, 8.0]
    assert set(gaps[4:]) == {8.0}  # never more than the cap apart
    assert len(asked_at) <= 40 / 0.5 / 10  # 8 questions in 40 s instead of 80 (one per tick)


def test_a_change_resets_the_pace_and_keys_are_independent():
    now = [0.0]
    b = Backoff(initial_s=1.0, max_s=30.0, clock=lambda: now[0])
    for _ in range(4):
        b.unchanged("a")
    assert b.delay("a") == 8.0 and not b.due("a")
    assert b.due("b")  # another key is not held back
    b.changed("a")
    assert b.due("a") and b.delay("a") == 0.0
