"""The broker contract on Redis Streams (consumer groups, XAUTOCLAIM)."""

from __future__ import annotations

import pytest

from .contract import BrokerContract

pytestmark = pytest.mark.redis


class TestRedisStreams(BrokerContract):
    redelivery_timeout_s = 10.0

    @pytest.fixture
    def broker_url(self, redis_url: str) -> str:
        # Entries idle for 1 s (a dead consumer's) are reclaimed by XAUTOCLAIM.
        return f"{redis_url}?claim_idle_ms=1000"
