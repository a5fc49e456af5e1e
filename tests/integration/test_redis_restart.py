"""Redis killed and restarted under a running store: errors are StoreUnavailableError, the same
store object reconnects (and re-loads its Lua scripts), and no message is lost.

Each test runs its own ``redis-server`` on a free port (never the shared one on 6379). The
business effects live in the shared Redis, so they survive the dedup server's death.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import idemq
from idemq.errors import StoreUnavailableError
from idemq.stores.redis.store import AsyncRedisStore, RedisStore
from tests.conftest import CI, port_open, unique

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throw-away redis-server on ``port``; ``kill`` is SIGKILL (a crash, not a shutdown)."""

    def __init__(self, port: int, workdir: Path, *, aof: bool) -> None:
        self.port, self.workdir, self.aof = port, workdir, aof
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        aof = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.aof
            else ["--appendonly", "no"]
        )
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *aof,
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", self.port, 0.1):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        client = redis.Redis(port=self.port)
        while True:  # with AOF, LOADING until the file is replayed
            try:
                client.ping()
                break
            except redis.BusyLoadingError:
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def spawn_server(tmp_path: Path) -> Iterator[Callable[[bool], RedisServer]]:
    if shutil.which("redis-server") is None:
        if CI:
            pytest.fail("redis-server binary missing (CI=true)")
        pytest.skip("redis-server binary missing")
    servers: list[RedisServer] = []

    def spawn(aof: bool) -> RedisServer:
        server = RedisServer(free_port(), tmp_path, aof=aof)
        server.start()
        servers.append(server)
        return server

    yield spawn
    for server in servers:
        if server.proc is not None:
            server.kill()


@pytest.fixture
def effects(redis_url: str) -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(redis_url)
    name = unique("idemqrestart")
    yield client, name
    client.delete(name)
    client.close()


def run(guard: idemq.Idempotency, client: redis.Redis, name: str, message_id: str) -> str:
    def handler(tx: object) -> int:
        return int(client.hincrby(name, message_id, 1))

    return guard.process(message_id, handler).status.value


@pytest.mark.parametrize("aof", [False, True], ids=["no-persistence", "aof"])
def test_restart_mid_run(
    spawn_server: Callable[[bool], RedisServer],
    effects: tuple[redis.Redis, str],
    aof: bool,
) -> None:
    client, name = effects
    server = spawn_server(aof)
    store = RedisStore(f"redis://127.0.0.1:{server.port}/0", socket_timeout_s=1)
    guard = idemq.Idempotency(store, consumer="restart", mode="lease", lease_s=30)
    ids = [f"ORDER_{i:03d}" for i in range(200)]

    for message_id in ids[:100]:
        assert run(guard, client, name, message_id) == "processed"

    server.kill()
    failed: list[str] = []
    started = time.monotonic()
    for message_id in ids[100:103]:  # the broker would nack/requeue these
        with pytest.raises(StoreUnavailableError) as info:
            run(guard, client, name, message_id)
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        failed.append(message_id)
    # redis-py's default retry/backoff rides out short blips before giving up; bounded though.
    assert time.monotonic() - started < 30

    server.start()  # same port: the same store object must reconnect and reload its scripts
    for message_id in failed + ids[103:]:
        assert run(guard, client, name, message_id) == "processed"

    # The redeliveries of messages done before the crash: with AOF the records survived, so
    # they are duplicates; without persistence the records are gone (documented: use AOF).
    replayed = [run(guard, client, name, message_id) for message_id in ids[:100]]
    expected_replay = "duplicate" if aof else "processed"
    assert set(replayed) == {expected_replay}

    counts = {k.decode(): int(v) for k, v in client.hgetall(name).items()}
    assert set(counts) == set(ids)  # nothing lost
    expected = {m: 1 for m in ids} if aof else {m: 2 if m in ids[:100] else 1 for m in ids}
    assert counts == expected
    store.close()


async def test_flushed_script_cache_is_reloaded(
    spawn_server: Callable[[bool], RedisServer], effects: tuple[redis.Redis, str]
) -> None:
    # The stores run their scripts by EVALSHA; SCRIPT FLUSH (or a failover to a replica that
    # never saw the scripts) must cost one EVAL of the source, not a failed message — sync and
    # async alike, the complete script as well as the claim.
    client, name = effects
    server = spawn_server(False)
    url = f"redis://127.0.0.1:{server.port}/0"
    admin = redis.Redis(port=server.port)
    store = RedisStore(url)
    astore = AsyncRedisStore(url)
    guard = idemq.Idempotency(store, consumer="flush", mode="lease", lease_s=30)
    aguard = idemq.AsyncIdempotency(astore, consumer="aflush", mode="lease", lease_s=30)

    async def ahandler(tx: object) -> int:
        return int(client.hincrby(name, "async", 1))

    for round_ in range(2):
        admin.script_flush()
        assert run(guard, client, name, f"m{round_}") == "processed"
        assert run(guard, client, name, f"m{round_}") == "duplicate"
        admin.script_flush()
        assert (await aguard.process(f"a{round_}", ahandler)).status is idemq.Status.PROCESSED
        assert (await aguard.process(f"a{round_}", ahandler)).status is idemq.Status.DUPLICATE
    counts = {k.decode(): int(v) for k, v in client.hgetall(name).items()}
    assert counts == {"m0": 1, "m1": 1, "async": 2}
    store.close()
    await astore.close()
    admin.close()
