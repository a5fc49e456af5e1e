"""The ids of outgoing messages: the same run of a message makes the same ids (a redelivered run
re-adds rows the next consumer's dedup row then catches), parts never run together, and code
outside a handler gets ids no other process can make."""

from __future__ import annotations

import re

from idemq.guard.context import HandlerContext, enter, leave
from idemq.ids.format import parse_message_id
from idemq.outbox.ids import (
    OUTBOX_ID_PREFIX,
    derived_id,
    derived_ids,
    next_outbox_id,
    process_node,
)


def test_a_derived_id_is_a_function_of_its_parts_and_of_fixed_length():
    first = derived_id("orders", "M1", 0)
    assert first == derived_id("orders", "M1", 0)  # a run rolled back and run again
    assert re.fullmatch(rf"{OUTBOX_ID_PREFIX}-[0-9a-f-]{{36}}", first)
    assert len(derived_id("c" * 500, "m" * 500, 10**6)) == len(first) == 43


def test_each_part_changes_the_id():
    base = derived_id("orders", "M1", 0)
    others = {
        derived_id("billing", "M1", 0),
        derived_id("orders", "M2", 0),
        derived_id("orders", "M1", 1),
        derived_id("orders", "M1", 0, generation=1),
    }
    assert base not in others
    assert len(others) == 4


def test_parts_that_join_alike_make_different_ids():
    # Joined with a separator these would be one name, and one message's effect lost.
    assert derived_id("a\x1fb", "c", 0) != derived_id("a", "b\x1fc", 0)
    assert derived_id("ab", "c", 0) != derived_id("a", "bc", 0)
    assert derived_id("x", "1", 23) != derived_id("x", "12", 3)


def test_generation_zero_is_the_id_of_the_first_run():
    assert derived_id("orders", "M1", 0, 0) == derived_id("orders", "M1", 0)


def test_inside_a_handler_the_ids_follow_the_runs_index_then_the_generations():
    token = enter(HandlerContext(consumer="orders", message_id="M7", owner="w1"))
    try:
        first = derived_ids()
        assert first is not None
        assert [next(first), next(first)] == [
            derived_id("orders", "M7", 0),
            derived_id("orders", "M7", 0, 1),
        ]
        assert next_outbox_id() == derived_id("orders", "M7", 1)  # the run's second add
    finally:
        leave(token)


def test_outside_a_handler_ids_are_generated_unique_and_parseable():
    assert derived_ids() is None
    ids = [next_outbox_id() for _ in range(200)]
    assert len(set(ids)) == 200
    parts = parse_message_id(ids[0])
    assert parts.prefix == OUTBOX_ID_PREFIX
    assert parts.node == parse_message_id(ids[-1]).node  # one node per process


def test_a_process_node_names_host_pid_and_a_random_part():
    node = process_node()
    assert re.fullmatch(r"H[0-9A-F]{8}-P\d+-R[0-9A-F]{8}", node)
    # pids are reused: the random part keeps a later process with the same pid apart.
    assert process_node() != node
