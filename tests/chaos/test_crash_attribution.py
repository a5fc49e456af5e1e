"""Crash duplicates are named from the deliveries: the armed worker writes a crash marker (the
message it holds) to its event file, durably, before it SIGKILLs itself, and the supervisor
dates a kill from the signal it sent, not from when it noticed the death.

Before the marker, on RabbitMQ the redelivered copy reached another worker before the supervisor
had seen the death, so nearly every crash duplicate was counted as ``other``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_service

from .conftest import PG_URL, chaos

pytestmark = pytest.mark.slow

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672/"


def test_rabbitmq_crash_duplicates_are_attributed_to_the_crash(tmp_path: Path) -> None:
    require_service("rabbitmq")
    require_service("postgres")
    # Paced: the run lasts ~7 s however fast the machine is, so kills come while it runs.
    result = chaos(RABBITMQ, PG_URL, tmp_path, messages=40, kill_every_s=1.0, rate_per_s=6.0)
    assert result.injected["kills_after_commit_before_ack"] > 0, result.to_json()
    assert result.causes["crash"] > 0, result.to_json()
    # An armed kill leaves a committed effect and no ack: its copy is answered DUPLICATE.
    assert result.suppressed_causes["crash"] > 0, result.to_json()
    # Nothing else was injected: every duplicate here is the kills' doing.
    assert result.causes["other"] == 0, result.to_json()
    assert result.causes["slow"] == result.causes["partition"] == 0, result.to_json()
