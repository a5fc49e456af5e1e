"""Cause attribution from worker events (pure logic: events written by hand)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from idemq.chaos.events import EventLog, Tally


def write(directory: Path, pid: int, events: list[dict[str, object]]) -> None:
    with (directory / f"events-{pid}.jsonl").open("a") as f:
        for event in events:
            f.write(json.dumps({"pid": pid, **event}) + "\n")


def start(seq: int, mid: str, copy: int, t: float) -> dict[str, object]:
    return {"k": "start", "seq": seq, "id": mid, "copy": copy, "t": t}


def done(seq: int, mid: str, verdict: str, t: float) -> dict[str, object]:
    return {"k": "done", "seq": seq, "id": mid, "v": verdict, "t": t}


def test_each_cause_is_named_from_what_happened(tmp_path: Path) -> None:
    write(
        tmp_path,
        1,
        [
            start(1, "m1", 1, 0.0),
            done(1, "m1", "processed", 0.1),  # first delivery
            start(2, "m2", 1, 1.0),  # slow: still running...
            start(3, "m3", 1, 2.0),  # killed before settling
        ],
    )
    write(
        tmp_path,
        2,
        [
            start(1, "m1", 2, 0.5),
            done(1, "m1", "duplicate", 0.6),  # producer retry's copy
            start(2, "m2", 1, 1.5),
            done(2, "m2", "duplicate", 1.6),  # ...when this came
            start(3, "m3", 1, 5.0),
            done(3, "m3", "processed", 5.1),  # after the kill
            start(4, "m4", 1, 6.0),
            done(4, "m4", "in_progress", 6.1),
            start(5, "m4", 1, 7.0),
            done(5, "m4", "processed", 7.1),  # asked-for retry
        ],
    )
    tally = Tally(tmp_path)
    tally.kill(1, 3.0)
    tally.poll()
    causes = tally.attribute()
    assert (causes["partition"], causes["slow"], causes["crash"], causes["other"]) == (1, 1, 1, 0)
    assert causes["retry"] == 1
    assert tally.verdicts()["duplicate"] == 2
    # m1's retried copy and m2's slow one were answered DUPLICATE; m3's crash copy did the work.
    suppressed = tally.suppressed_by_cause()
    assert dict(suppressed) == {"partition": 1, "slow": 1, "crash": 0, "cut": 0, "other": 0}
    timeline = tally.timeline(0.0, 1.0)
    assert sum(p["deliveries"] for p in timeline) == 8
    assert sum(p["kills"] for p in timeline) == 1


def test_a_copy_handed_to_another_host_during_a_cut_is_the_cuts(tmp_path: Path) -> None:
    # Host 1 (pid 1) holds m1 when it goes off the network at 1.0 s; the broker gives m1 to pid
    # 2 at 4.0 s; back at 11.0 s, pid 1 ends its delivery with an error (its transaction was
    # gone). A slow delivery on pid 2 outside the cut stays "slow".
    write(
        tmp_path,
        1,
        [start(1, "m1", 1, 0.5), done(1, "m1", "handler_error", 11.5)],
    )
    write(
        tmp_path,
        2,
        [
            start(1, "m1", 1, 4.0),
            done(1, "m1", "processed", 4.1),
            start(2, "m2", 1, 20.0),
            start(3, "m2", 1, 21.0),  # while its first delivery (same pid, no cut) ran
            done(3, "m2", "duplicate", 21.5),
            done(2, "m2", "processed", 22.0),
        ],
    )
    tally = Tally(tmp_path)
    tally.poll()
    tally.cut({1}, 1.0, 11.0)
    causes = tally.attribute()
    assert (causes["cut"], causes["slow"], causes["retry"]) == (1, 1, 0)
    assert tally.cut_off(tally.deliveries[0])


def test_a_torn_last_line_waits_and_bad_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events-7.jsonl"
    path.write_text(
        '{"k": "start", "pid": 7, "seq": 1, "id": "a", "copy": 1, "t": 1}\nnot json\n{"k": "st'
    )
    tally = Tally(tmp_path)
    tally.poll()
    assert [d.message_id for d in tally.deliveries] == ["a"]
    with path.open("a") as f:
        f.write('art", "pid": 7, "seq": 2, "id": "b", "copy": 1, "t": 2}\n')
    tally.poll()
    assert [d.message_id for d in tally.deliveries] == ["a", "b"]


def test_event_log_appends_one_line_per_event(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.write("start", seq=1, id="x", copy=1)
    log.write("done", seq=1, id="x", v="processed")
    log.close()
    tally = Tally(tmp_path)
    tally.poll()
    assert [(d.message_id, d.verdict) for d in tally.deliveries] == [("x", "processed")]


def test_a_crash_marker_names_the_cause_before_the_supervisor_notices(tmp_path: Path) -> None:
    """RabbitMQ hands the dead worker's message to another one before the supervisor's next
    tick: the copy starts before the death is *seen*, so only the marker can name it."""
    write(
        tmp_path,
        1,
        [
            start(1, "m1", 1, 0.0),
            done(1, "m1", "processed", 0.1),  # committed...
            {"k": "kill", "id": "m1", "where": "after_commit_before_ack", "t": 0.11},  # ...died
        ],
    )
    write(tmp_path, 2, [start(1, "m1", 1, 0.2), done(1, "m1", "duplicate", 0.3)])
    tally = Tally(tmp_path)
    tally.kill(1, 0.5)  # the supervisor saw the death after the copy had arrived
    tally.poll()
    causes = tally.attribute()
    assert (causes["crash"], causes["other"]) == (1, 0)
    assert tally.suppressed_by_cause()["crash"] == 1
    assert tally.self_kills == 1
    assert tally.killed_at_s[1] == 0.11  # dated by the marker, the earlier of the two


def test_a_marker_written_durably_survives_the_kill(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.write("start", seq=1, id="x", copy=1)
    log.write("kill", durable=True, id="x")
    log.close()
    tally = Tally(tmp_path)
    tally.poll()
    assert tally.crash_marked == {(os.getpid(), "x")}


def test_a_relay_republish_after_the_relay_died_is_a_crash(tmp_path: Path) -> None:
    """Two hops: relay 50 published the ship message and died before deleting its row; relay 60
    published it again (same id, its own pid on the copy)."""
    first = {**start(1, "s1", 1, 1.0), "relay": 50}
    again = {**start(1, "s1", 1, 3.0), "relay": 60}
    write(tmp_path, 1, [first, done(1, "s1", "processed", 1.1)])
    write(tmp_path, 2, [again, done(1, "s1", "duplicate", 3.1)])
    write(
        tmp_path, 50, [{"k": "kill", "id": "s1", "where": "after_publish_before_delete", "t": 1.5}]
    )
    tally = Tally(tmp_path)
    tally.poll()
    causes = tally.attribute()
    assert (causes["crash"], causes["partition"]) == (1, 0)
    assert (tally.relay_self_kills, tally.self_kills) == (1, 0)
    assert tally.suppressed_by_cause()["crash"] == 1
