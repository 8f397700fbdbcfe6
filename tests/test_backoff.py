"""The one backoff rule every retry in Kazma uses."""

from __future__ import annotations

import pytest

from kazma.config.backoff import Backoff


def test_delays_grow_double_each_retry_up_to_the_cap_without_jitter() -> None:
    backoff = Backoff(base=0.5, cap=4.0, jitter=False)
    assert [backoff.delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_jitter_keeps_each_delay_between_half_and_all_of_its_ceiling() -> None:
    backoff = Backoff(base=0.5, cap=30.0)
    for retry in range(8):
        ceiling = backoff.ceiling(retry)
        samples = {backoff.delay(retry) for _ in range(200)}
        assert all(ceiling / 2 <= delay <= ceiling for delay in samples)
        assert len(samples) > 1  # callers that failed together do not retry together


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 0.5), (1.0, 1.0), (-3.0, 0.5), (7.0, 1.0)])
def test_the_random_draw_is_clamped(draw: float, factor: float) -> None:
    assert Backoff(base=2.0, cap=2.0, rng=lambda: draw).delay(0) == 2.0 * factor


def test_a_platforms_retry_after_wins_when_longer() -> None:
    backoff = Backoff(base=0.5, cap=60.0, jitter=False)
    assert backoff.delay(0, retry_after=7.5) == 7.5
    assert backoff.delay(4, retry_after=1.0) == 8.0


def test_huge_retry_counts_stay_finite_and_capped() -> None:
    assert Backoff(base=0.5, cap=60.0, jitter=False).delay(10_000) == 60.0


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_nonsense_settings_are_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="0 < base <= cap"):
        Backoff(base=base, cap=cap)
