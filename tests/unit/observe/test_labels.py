"""Metric and log labels: a fixed vocabulary that never carries an error's text (an unbounded
label set breaks Prometheus, and the text may quote the payload), and dead-letter details
shortened to their error's class for a log line."""

from __future__ import annotations

import pytest

from idemq.errors import (
    InvalidMessageIdError,
    LeaseLostError,
    PayloadMismatchError,
    StoreConfigurationError,
    StoreConflictError,
    StoreUnavailableError,
    TransactionLostError,
)
from idemq.guard.core import Outcome, Status
from idemq.observe.labels import error_kind, outcome_label
from idemq.observe.logs import redact_detail

MISMATCH = PayloadMismatchError("ORDER-7", "sha256:aa", "sha256:bb")


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (MISMATCH, "payload_mismatch"),
        (InvalidMessageIdError("id 'x\x00' has a NUL"), "invalid_message"),
        (LeaseLostError("taken over"), "lease_lost"),
        (StoreUnavailableError("db1.internal:5432 refused"), "store_unavailable"),
        # The other store errors share one label: each is rare and its class is in the log.
        (StoreConfigurationError("password authentication failed"), "store"),
        (TransactionLostError("row gone"), "store"),
        (StoreConflictError("deadlock"), "store"),
        (KeyError("card"), "handler"),
    ],
)
def test_every_error_maps_to_one_word_of_a_fixed_vocabulary(error: BaseException, kind: str):
    assert error_kind(error) == kind


def test_the_vocabulary_stays_small():
    words = {
        error_kind(e)
        for e in (
            MISMATCH,
            InvalidMessageIdError(),
            LeaseLostError(),
            StoreUnavailableError(),
            StoreConflictError(),
            RuntimeError(),
        )
    }
    assert words == {
        "payload_mismatch",
        "invalid_message",
        "lease_lost",
        "store_unavailable",
        "store",
        "handler",
    }


def test_an_outcome_is_labelled_by_its_status_and_a_failed_batch_message_by_its_error():
    assert outcome_label(Outcome.processed("M1", 1), None) == "processed"
    assert outcome_label(Outcome(Status.DUPLICATE, "M1"), None) == "duplicate"
    assert outcome_label(Outcome.failed("M1", MISMATCH), None) == "payload_mismatch"
    assert outcome_label(Outcome.failed("M1", ValueError("boom")), None) == "error"
    assert outcome_label(None, MISMATCH) == "payload_mismatch"
    assert outcome_label(None, StoreUnavailableError()) == "error"


@pytest.mark.parametrize(
    ("detail", "logged"),
    [
        ("ValueError: card 4111 declined", "ValueError"),
        ("psycopg.errors.UniqueViolation: key (id)=(7)", "psycopg.errors.UniqueViolation"),
        ("undecodable", "undecodable"),  # idemq's own words: nothing to hide
        (
            "no message id (neither a broker id nor idemq-message-id)",
            "no message id (neither a broker id nor idemq-message-id)",
        ),
    ],
)
def test_a_dead_letter_detail_is_logged_as_its_class_only(detail: str, logged: str):
    assert redact_detail(detail) == logged
