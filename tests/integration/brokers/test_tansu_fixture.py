"""The test Kafka broker is always one of our own: a free port, started, waited for, stopped by
PID — never whatever someone else left listening on a fixed port."""

from __future__ import annotations

import socket

import confluent_kafka.admin
import pytest

from tests.conftest import port_open

from .test_kafka import run_tansu

pytestmark = pytest.mark.kafka


def answers_kafka(bootstrap: str) -> bool:
    admin = confluent_kafka.admin.AdminClient({"bootstrap.servers": bootstrap})
    return admin.list_topics(timeout=10).brokers != {}


def test_two_suites_get_two_brokers_each_stopped_afterwards() -> None:
    with run_tansu() as first, run_tansu() as second:
        assert first != second
        assert answers_kafka(first)
        assert answers_kafka(second)
    for bootstrap in (first, second):
        host, port = bootstrap.split(":")
        assert not port_open(host, int(port))  # stopped, not left behind


def test_a_port_someone_else_holds_is_not_adopted() -> None:
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]
        with pytest.raises((pytest.skip.Exception, pytest.fail.Exception)), run_tansu(port):
            pass  # pragma: no cover - Tansu cannot bind a port that is taken
