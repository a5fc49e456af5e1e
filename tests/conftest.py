"""Shared fixtures: real services, found by port.

A test that needs a service skips when the service is unreachable on a developer's machine, and
**fails** when ``CI=true`` — a green CI run must never hide a service that did not start.

The suite runs in parallel (pytest-xdist, README's test command): names are unique per test
(:func:`unique`), ports come from the OS (:func:`free_port`), and a test that changes a setting of
a shared server for everyone takes that server alone (:func:`server_wide`). Markers are applied
here, from where a test lives and what it uses, so new test files get them without a word.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from tests.redis_cluster import RedisCluster

CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

SERVICES: dict[str, tuple[str, int]] = {
    "postgres": ("127.0.0.1", 5432),
    "mysql": ("127.0.0.1", 3306),
    "redis": ("127.0.0.1", 6379),
    "rabbitmq": ("127.0.0.1", 5672),
    "mqtt": ("127.0.0.1", 1883),
    "nats": ("127.0.0.1", 4222),
}

PG_URL = os.environ.get("IDEMQ_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("IDEMQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; released at once)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


def require_service(name: str) -> None:
    """Skip (locally) or fail (under CI=true) when ``name`` is not reachable.

    While the calling test runs, it shares ``name`` with the other tests that use it: a test that
    changes the whole server (:func:`server_wide`) waits for them to finish, and they for it.
    """
    host, port = SERVICES[name]
    if port_open(host, port):
        _take_service(name, exclusive=False)
        return
    message = f"{name} is not reachable at {host}:{port}"
    if CI:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(message)


def unique(prefix: str = "t") -> str:
    """A short unique name for tables/consumers so concurrent test runs never collide."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], what: str, timeout_s: float = 30.0, interval_s: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something true, and return that; fail the test,
    naming ``what``, after ``timeout_s``. A fixed sleep is either too long on an idle machine or
    too short on a loaded one: this waits exactly as long as the condition takes."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return result


# -- services shared by parallel workers ----------------------------------------------------
# One lock file per service, in the machine's temp directory, so every pytest process (xdist
# workers, and other runs of the suite on this machine) sees the same one. flock's shared mode
# lets any number of ordinary tests use a service together; the exclusive mode lets a test that
# changes a server-wide setting (RabbitMQ's consumer_timeout) run only when no other test is on
# that server, so no other test's channel is opened under the changed setting.
SERVICE_LOCKS = Path(tempfile.gettempdir()) / "idemq-test-services"
_held_services: dict[str, int] = {}  # service -> this process's open lock file on it


def _take_service(name: str, exclusive: bool) -> None:
    fd = _held_services.get(name)
    if fd is None:
        SERVICE_LOCKS.mkdir(mode=0o777, exist_ok=True)
        fd = os.open(SERVICE_LOCKS / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        _held_services[name] = fd
    elif not exclusive:
        return  # already shared (or exclusive) for this test
    fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)


def _release_services() -> None:
    while _held_services:
        _, fd = _held_services.popitem()
        os.close(fd)  # closing the last descriptor releases the flock


def server_wide(name: str) -> None:
    """Take service ``name`` alone for the rest of the calling test (see ``SERVICE_LOCKS``)."""
    require_service(name)
    _take_service(name, exclusive=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Services a test took are given back once it is over, teardown included."""
    try:
        return (yield)
    finally:
        _release_services()


# -- markers ----------------------------------------------------------------------------------
#: Rooms whose tests run real processes, servers or model checkers end to end: all ``slow``. The
#: fast loop (``-m "not slow"``) is tests/unit and tests/contract, less what is marked there.
SLOW_ROOMS = {"integration", "chaos", "hosts", "docs", "browser", "models"}
#: A word in a test's id (module, class, name, parameters) or a fixture it uses -> its marker.
SERVICE_WORDS = {
    "postgres": "postgres",
    "postgresql": "postgres",
    "pg": "postgres",
    "pg_url": "postgres",
    "mysql": "mysql",
    "mariadb": "mysql",
    "maria": "mysql",
    "mysql_url": "mysql",
    "redis": "redis",
    "redis_url": "redis",
    "redis_cluster": "redis",
    "rabbitmq": "rabbitmq",
    "amqp": "rabbitmq",
    "kafka": "kafka",
    "tansu": "kafka",
    "kafka_behind_proxy": "kafka",
    "nats": "nats",
    "mqtt": "mqtt",
}
TESTS = Path(__file__).parent
#: Rooms whose tests are chaos runs: several processes each, busy on the CPU, killed and cut on
#: timers. More than two at once on a 2-core machine starve each other past their deadlines, so
#: their tests are dealt in turn to this many xdist groups (a group runs on one worker, one test
#: at a time) unless a module names its own group.
CHAOS_ROOMS = {"chaos", "hosts"}
CHAOS_LANES = 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` on the end-to-end rooms; a service's marker on every test whose id or fixtures
    name it, so ``-m postgres`` (or ``-m "not kafka"``) selects what it says; the chaos runs in
    at most ``CHAOS_LANES`` groups."""
    chaos_runs = 0
    for item in items:
        room = item.path.relative_to(TESTS).parts[0] if TESTS in item.path.parents else ""
        if room in SLOW_ROOMS:
            item.add_marker(pytest.mark.slow)
        if room in CHAOS_ROOMS and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"chaos-{chaos_runs % CHAOS_LANES}"))
            chaos_runs += 1
        words = {*re.split(r"[^a-z0-9]+", item.nodeid.lower()), *item.fixturenames}
        for service in sorted({SERVICE_WORDS[w] for w in words if w in SERVICE_WORDS}):
            item.add_marker(service)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'idemq.db'}"


@pytest.fixture
def pg_url() -> str:
    require_service("postgres")
    return PG_URL


@pytest.fixture
def mysql_url() -> str:
    require_service("mysql")
    return MYSQL_URL


@pytest.fixture
def redis_url() -> str:
    require_service("redis")
    return REDIS_URL


SQL_BACKENDS = ["sqlite", "postgres", "mysql"]


@pytest.fixture(params=SQL_BACKENDS)
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each SQL backend in turn: SQLite (a temp file), PostgreSQL, MariaDB."""
    backend: str = request.param
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'idemq.db'}"
    require_service(backend)
    return PG_URL if backend == "postgres" else MYSQL_URL


def terminate_pg_sessions(application_name: str) -> int:
    """End every PostgreSQL session of ``application_name`` (as a server restart or a network
    cut would, seen from the client); how many there were."""
    import sqlalchemy as sa  # noqa: PLC0415

    admin = sa.create_engine(PG_URL)
    try:
        with admin.begin() as conn:
            ended = conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application_name},
            ).all()
        return len(ended)
    finally:
        admin.dispose()


def delete_queues(broker_url: str, queue: str) -> None:
    """Delete ``queue`` and its dead-letter queue (tests share the brokers)."""
    from idemq.brokers import open_broker  # noqa: PLC0415

    broker = open_broker(broker_url)
    try:
        broker.delete_queue(queue)
        broker.delete_queue(broker.dead_letter_queue(queue))
    finally:
        broker.close()


def redis_cleanup(prefix: str) -> None:
    """Delete every key a test's store or lock wrote under ``prefix`` (tests share one Redis)."""
    import redis  # noqa: PLC0415

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of three masters and three replicas, started once for the session from
    the machine's redis-server (skips locally without it, fails under CI=true)."""
    from tests.redis_cluster import start_cluster  # noqa: PLC0415

    cluster = start_cluster()
    yield cluster
    cluster.stop()


def redis_cluster_cleanup(client: Any, prefix: str) -> None:
    """:func:`redis_cleanup` on a Cluster, through a sync Cluster client: redis-py's scan_iter
    visits every master; keys are deleted one by one (each is in a slot of its own)."""
    for key in list(client.scan_iter(match=f"{prefix}*", count=1000)):
        client.delete(key)
