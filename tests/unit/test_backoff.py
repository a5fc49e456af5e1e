"""The one backoff: doubling from the first wait up to the cap, jitter only below the wait."""

from __future__ import annotations

import pytest

from idemq._backoff import Backoff


def test_doubles_from_first_to_its_cap() -> None:
    backoff = Backoff(0.5, 4.0)
    assert [backoff.delay_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_attempts_before_the_first_wait_the_first_and_huge_ones_the_cap() -> None:
    backoff = Backoff(0.1, 30.0)
    assert backoff.delay_s(0) == backoff.delay_s(-3) == 0.1
    assert backoff.delay_s(10_000) == 30.0  # no float overflow after a day of outage


@pytest.mark.parametrize(
    ("jitter", "draw", "expected"),
    [
        (0.0, 0.99, 2.0),  # no jitter: the draw is never asked for
        (0.5, 0.0, 2.0),  # half jitter: between half the wait and all of it
        (0.5, 0.5, 1.5),
        (1.0, 0.75, 0.5),  # full jitter: anywhere below the wait
    ],
)
def test_jitter_takes_a_random_share_below_the_wait(
    jitter: float, draw: float, expected: float
) -> None:
    asked: list[None] = []

    def random() -> float:
        asked.append(None)
        return draw

    assert Backoff(1.0, 8.0, jitter=jitter).delay_s(2, random) == pytest.approx(expected)
    assert len(asked) == (1 if jitter else 0)


def test_jitter_never_goes_past_the_cap() -> None:
    backoff = Backoff(1.0, 3.0, jitter=1.0)
    assert backoff.delay_s(5, lambda: 0.0) == 3.0


@pytest.mark.parametrize("jitter", [-0.1, 1.5])
def test_jitter_outside_zero_to_one_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError, match="jitter"):
        Backoff(1.0, 2.0, jitter=jitter)
