"""A node lease's local deadline, on an injected clock and a SQLite file (no server): ids stop
a safety margin before the store's expiry, a renewal counts from when it was sent, and a lost
lease stays lost. The races between processes are tests/integration/test_node_lease.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from idemq.errors import ConfigurationError, LeaseLostError
from idemq.ids.node_lease import NodeLease, lease_node


class Clock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'leases.db'}"


def lease(url: str, clock: Clock, **options: object) -> NodeLease:
    return lease_node(
        url, pool="ORDER", ttl_s=30.0, renew_in_background=False, monotonic=clock, **options
    )


def test_ids_stop_a_margin_before_the_stores_expiry(url: str):
    clock = Clock()
    with lease(url, clock) as held:
        assert held.node == "N001"
        clock.now_s += 28.9
        held.ensure_valid()
        assert not held.lost
        clock.now_s += 0.1  # 1 s (a tenth of the ttl, at most 1 s) before the expiry
        with pytest.raises(LeaseLostError, match=r"not renewed within ttl_s=30\.0"):
            held.ensure_valid()
        assert held.lost


def test_a_lost_lease_stays_lost_even_if_the_clock_reads_earlier(url: str):
    clock = Clock()
    lost: list[NodeLease] = []
    with lease(url, clock, on_lost=lost.append) as held:
        clock.now_s += 40
        with pytest.raises(LeaseLostError):
            held.renew()
        clock.now_s -= 40
        assert held.lost
        with pytest.raises(LeaseLostError):
            held.ensure_valid()
        assert lost == [held]  # told once


def test_a_renewal_moves_the_deadline_to_its_send_time_plus_the_ttl(url: str):
    clock = Clock()
    with lease(url, clock) as held:
        clock.now_s += 20
        held.renew()
        clock.now_s += 28.9  # 48.9 s after the acquire, 28.9 s after the renewal
        held.ensure_valid()
        clock.now_s += 1.2
        assert held.lost


def test_a_pool_whose_nodes_are_all_held_is_refused_until_one_is_released(url: str):
    clock = Clock()
    first = lease(url, clock, nodes=[1], release_hold_s=0)
    try:
        with pytest.raises(ConfigurationError, match="all 1 node ids of pool 'ORDER'"):
            lease(url, clock, nodes=[1])
    finally:
        first.close()
    with lease(url, clock, nodes=[1]) as second:
        assert second.node == "N001"


@pytest.mark.parametrize(
    "options",
    [
        {"nodes": []},
        {"nodes": [1, "N001"]},  # one node named twice
        {"nodes": ["N_1"]},  # "_" separates the parts of an id
        {"ttl_s": 0},
        {"release_hold_s": -1},
    ],
)
def test_bad_arguments_are_refused_before_the_store_is_touched(
    tmp_path: Path, options: dict[str, object]
):
    arguments: dict[str, object] = {"pool": "ORDER", "renew_in_background": False, **options}
    with pytest.raises(ConfigurationError):
        lease_node(f"sqlite:///{tmp_path / 'never.db'}", **arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "never.db").exists()
