"""The I/O-free core: validation, hashing, result encoding, the claim verdict."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import hashlib
import json
import uuid

import pytest

import idemq
from idemq.guard.batch_flow import plan_batch
from idemq.guard.codec import decode_result, encode_result, hash_payload
from idemq.guard.core import Mode, Policy, Status, judge, validate_business_id
from idemq.stores.base import Claim, Key, Record, RecordStatus


def policy(**kw: object) -> Policy:
    args = {"consumer": "c", "mode": "lease", "lease_s": 30.0, "clock": lambda: 1_000}
    args.update(kw)
    return Policy.build(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, 0, False, "", [], {}, -1.5, "ü", [None, {"a": [1]}]])
def test_results_round_trip(value: object):
    assert decode_result(encode_result(value)) == value


@pytest.mark.parametrize("text", [" 1", "1 ", '{"a": [1, 2]}\n', "\t[]", '"ü"', "-0.5"])
def test_decoding_reads_stored_json_as_json_loads_does(text: str):
    # Not what encode_result writes (compact), but text a record may hold: same value as before.
    assert decode_result(text) == json.loads(text)


def test_decoding_takes_bytes_from_a_binary_column():
    assert decode_result(b'{"ok":true}') == {"ok": True}  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "1 2", "{", "[1]]", "nul", "'a'"])
def test_decoding_refuses_what_json_loads_refuses(text: str):
    with pytest.raises(json.JSONDecodeError):
        decode_result(text)


STORABLE = [0, True, "", 'é\u2028"\\', -0.5, 1e300, 2**70, Status.PROCESSED, Mode.LEASE]
STORABLE += [[1, "a", None], {"ü": {"n": [1.25, False]}, "": []}, (1, 2), {"k": (3,)}]


@pytest.mark.parametrize("value", STORABLE)
def test_results_are_stored_as_compact_json(value: object):
    expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert encode_result(value) == expected


@pytest.mark.parametrize("value", [object(), {1, 2}, float("nan"), b"bytes", {"a": [object()]}])
def test_unstorable_results_are_refused(value: object):
    with pytest.raises(idemq.ResultNotSerializableError):
        encode_result(value)


def test_a_result_that_contains_itself_is_refused():
    cycle: list[object] = [1]
    cycle.append({"again": cycle})
    with pytest.raises(idemq.ResultNotSerializableError):
        encode_result(cycle)
    assert encode_result({"after": [1]}) == '{"after":[1]}'  # the encoder is still sound


def test_payload_hash_is_canonical_for_json_and_exact_for_bytes():
    assert hash_payload({"a": 1, "b": 2}) == hash_payload({"b": 2, "a": 1})
    assert hash_payload(b"x") == hash_payload("x")
    assert hash_payload(b"x") != hash_payload(b"x ")
    assert hash_payload(None) is None
    with pytest.raises(idemq.InvalidMessageError):
        hash_payload(object())


@pytest.mark.parametrize("bad", ["", "x" * 65, 5, "a\x00"])
def test_business_id_validation(bad: object):
    with pytest.raises(idemq.InvalidBusinessIdError):
        validate_business_id(bad)


@pytest.mark.parametrize(
    "kw", [{"consumer": ""}, {"consumer": 3}, {"mode": "eventual"}, {"lease_s": 0}]
)
def test_policy_refuses_bad_configuration(kw: dict[str, object]):
    with pytest.raises(idemq.ConfigurationError):
        policy(**kw)


def test_requests_carry_a_fresh_owner_and_lease_only_in_lease_mode():
    lease = policy()
    first, second = lease.request("m"), lease.request("m")
    assert first.owner != second.owner
    assert first.lease_until_ms == 1_000 + 30_000
    assert policy(mode="transactional").request("m").lease_ms == 0


def record(status: RecordStatus, payload_hash: str | None = "h", result: str | None = '"r"'):
    return Record("c", "m", status, payload_hash=payload_hash, result=result)


def test_judge_maps_a_claim_to_an_outcome():
    guard_policy = policy()
    request = guard_policy.request("m")
    assert judge(guard_policy, request, Claim.won()) is None
    done = judge(guard_policy, request, Claim.lost_to(record(RecordStatus.PROCESSED)))
    assert done is not None
    assert (done.status, done.result, done.should_ack) == (Status.DUPLICATE, "r", True)
    busy = judge(guard_policy, request, Claim.lost_to(record(RecordStatus.PROCESSING, result=None)))
    assert busy is not None
    assert (busy.status, busy.should_ack) == (Status.IN_PROGRESS, False)


def test_judge_refuses_another_payload_under_the_same_id():
    guard_policy = policy()
    request = guard_policy.request("m", payload=b"new")
    with pytest.raises(idemq.PayloadMismatchError):
        judge(
            guard_policy, request, Claim.lost_to(record(RecordStatus.PROCESSED, payload_hash="old"))
        )


def test_modes_are_named():
    assert Mode("lease") is Mode.LEASE
    assert Key("c", "m") == Key("c", "m")


def test_a_repeated_id_with_another_body_in_one_batch_is_a_payload_mismatch():
    plan = plan_batch(
        policy(),
        [
            idemq.Message(id="m", body=b"first"),
            idemq.Message(id="m", body=b"first"),
            idemq.Message(id="m", body=b"other"),
        ],
    )
    assert len(plan.requests) == 1
    assert plan.slots[:2] == [0, 0]
    mismatch = plan.slots[2]
    assert not isinstance(mismatch, int)
    assert mismatch.status is Status.FAILED
    assert isinstance(mismatch.error, idemq.PayloadMismatchError)


def test_payload_hashing_is_canonical():
    tz = datetime.timezone(datetime.timedelta(hours=2))
    same = [
        ({"b": 1, "a": [1, 2]}, {"a": [1, 2], "b": 1}),
        ({1, 2, 3}, {3, 1, 2}),
        ((1, "x"), [1, "x"]),
        (decimal.Decimal("1.50"), decimal.Decimal("1.5")),
        (
            datetime.datetime(2024, 1, 1, 12, tzinfo=tz),
            datetime.datetime(2024, 1, 1, 10, tzinfo=datetime.UTC),
        ),
        ({"mode": Mode.LEASE}, {"mode": "lease"}),
        ({"id": uuid.UUID(int=1)}, {"id": str(uuid.UUID(int=1))}),
        ({"raw": b"\x01\xff"}, {"raw": "01ff"}),
        (Point(1, 2), {"x": 1, "y": 2}),
    ]
    for left, right in same:
        assert hash_payload(left) == hash_payload(right), (left, right)
    assert hash_payload(decimal.Decimal("1.5")) != hash_payload(decimal.Decimal("1.51"))
    assert hash_payload({"amount": 1}) != hash_payload({"amount": 2})


def test_json_payloads_hash_as_they_always_have():
    # A message delivered before an upgrade and again after it must still be recognised.
    payload = {"b": [1, 2.5, None, True], "a": "ü", "n": {"z": 1, "y": {}}}
    legacy = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hash_payload(payload) == hashlib.sha256(legacy.encode()).hexdigest()


@pytest.mark.parametrize("value", [{1: "a", "b": 2}, decimal.Decimal("NaN"), object()])
def test_payloads_without_a_canonical_form_are_refused(value: object):
    with pytest.raises(idemq.InvalidMessageError):
        hash_payload(value)


@dataclasses.dataclass
class Point:
    x: int
    y: int
