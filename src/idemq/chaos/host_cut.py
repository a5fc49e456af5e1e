"""``idemq chaos --hosts N``: the workers spread over N hosts, and host 1 cut off the network
while it holds messages.

Each host is a network namespace (:mod:`idemq.chaos.hosts`) whose processes reach the broker,
the store and the ledger only through forwarders on the far side of its veth. Slot ``i`` of
the supervisor runs on host ``i mod N + 1``. Once a third of the messages are applied and host
1 holds a delivery it has not settled (or nine tenths are applied, whatever it holds), its veth goes
down for ``cut_s`` — longer than a lease and than the servers' timers below — and comes back.
Host 1's handlers pause :data:`HOLD_S` before each commit, so it is mid-message when it goes::

    host 1   claims m, starts the effect ──── veth down: packets vanish ──── back: its late
             ack/commit/complete meets a world that moved on (refused, or a duplicate)
    host 2   ................... broker gives m to host 2 (host 1 missed its heartbeats) → applies

The servers decide that host 1 is gone by their own timers, which the worker URLs of this mode
set short: RabbitMQ's heartbeat (``heartbeat=2``: the broker drops the connection and requeues
its unacked deliveries) and PostgreSQL's ``idle_in_transaction_session_timeout`` (4 s: the
server rolls host 1's open transaction back and frees its dedup rows' locks). MariaDB/MySQL have
no URL-settable equivalent: there, the other hosts' copies wait on host 1's locks until it is
back. The verdict is the run's usual one, from the ledger: every effect once, nothing lost.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from sqlalchemy.engine import make_url

from idemq.chaos.events import Tally
from idemq.chaos.hosts import Host, HostProcess, hosts
from idemq.chaos.worker import WorkerSpec
from idemq.errors import ConfigurationError

__all__ = ["CUT_HOST", "HostCut", "check_urls"]

CUT_HOST = 1
"""The host that is cut off (its slots are 0, N, 2N …)."""

HOLD_S = 0.3
"""How long each handler on the cut host waits before its commit, so that it holds a message
when the cut comes (below every broker's redelivery timer of a chaos run)."""

HEARTBEAT_S = 2
IDLE_IN_TRANSACTION_MS = 4000

# URL schemes a host reaches through one forwarder (a Redis store's URL is one of them).
_BROKER_PORTS = {"amqp": 5672, "nats": 4222, "redis": 6379, "rediss": 6379}
_SQL_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def _broker_upstream(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in _BROKER_PORTS:
        raise ConfigurationError(
            f"idemq chaos --hosts runs on RabbitMQ, NATS and Redis Streams, not {parts.scheme}://"
            " (Kafka clients dial the broker's advertised address, which a host's forwarder"
            " cannot stand in for; MQTT and the embedded queue have no redelivery to another"
            " host that a cut would set off)"
        )
    return parts.hostname or "127.0.0.1", parts.port or _BROKER_PORTS[parts.scheme]


def _sql_upstream(url: str) -> tuple[str, int]:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend not in _SQL_PORTS:
        raise ConfigurationError(
            "idemq chaos --hosts needs a store and a ledger reached over the network"
            f" (PostgreSQL, MariaDB/MySQL, Redis), not {backend}: a host cut off the network"
            " would still reach a file (a Redis store's ledger: pass --ledger URL)"
        )
    return parsed.host or "127.0.0.1", parsed.port or _SQL_PORTS[backend]


def _plain_url(url: str) -> bool:
    """A broker's or Redis's URL (one server by scheme), not an SQLAlchemy one."""
    return urllib.parse.urlsplit(url).scheme in _BROKER_PORTS


def _upstream(url: str) -> tuple[str, int]:
    return _broker_upstream(url) if _plain_url(url) else _sql_upstream(url)


def check_urls(broker_url: str, store_url: str, ledger_url: str) -> list[tuple[str, int]]:
    """The distinct servers a host must reach, or :class:`~idemq.ConfigurationError` naming
    what ``--hosts`` cannot spread over hosts."""
    upstreams = [_broker_upstream(broker_url), _upstream(store_url), _upstream(ledger_url)]
    return list(dict.fromkeys(upstreams))


def _through(url: str, endpoint: str) -> str:
    """``url`` dialled through ``endpoint`` (a forwarder), with this mode's short timers."""
    host, port = endpoint.split(":")
    if _plain_url(url):
        parts = urllib.parse.urlsplit(url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@{endpoint}" if auth else endpoint
        query = urllib.parse.parse_qs(parts.query)
        if parts.scheme == "amqp" and "heartbeat" not in query:
            query["heartbeat"] = [str(HEARTBEAT_S)]
        return urllib.parse.urlunsplit(
            parts._replace(netloc=netloc, query=urllib.parse.urlencode(query, doseq=True))
        )
    parsed = make_url(url).set(host=host, port=int(port))
    if parsed.get_backend_name() == "postgresql" and "options" not in parsed.query:
        timeout = f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}"
        parsed = parsed.update_query_dict({"options": timeout})
    return parsed.render_as_string(hide_password=False)


@dataclass
class HostCut:
    """Where each process runs, and the one cut; see the module doc."""

    hosts: list[Host]
    directory: Path
    cut_s: float
    pid_host: dict[int, int] = field(default_factory=dict)
    cut_from_s: float | None = None  # wall clock
    cut_to_s: float | None = None
    _logs: dict[int, IO[bytes]] = field(default_factory=dict)
    _spawned: int = 0

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, count: int, upstreams: list[tuple[str, int]], cut_s: float, directory: Path
    ) -> Iterator[HostCut]:
        """``count`` hosts with a forwarder to each of ``upstreams``; removed on exit."""
        services = {f"{host}:{port}": (host, port) for host, port in upstreams}
        with hosts(count, services) as made:
            cut = cls(made, directory, cut_s)
            try:
                yield cut
            finally:
                if cut.cut_from_s is not None and cut.cut_to_s is None:
                    cut.hosts[CUT_HOST - 1].restore()
                for log in cut._logs.values():
                    log.close()

    def host_of(self, slot: int) -> Host:
        return self.hosts[slot % len(self.hosts)]

    def spawn(self, slot: int, spec: WorkerSpec) -> HostProcess:
        """Start ``slot``'s process on its host, its URLs through that host's forwarders."""
        host = self.host_of(slot)
        if host.index not in self._logs:
            self._logs[host.index] = (self.directory / f"host{host.index}.log").open("ab")
        self._spawned += 1
        spec = replace(
            spec,
            broker_url=self._via(host, spec.broker_url),
            store_url=self._via(host, spec.store_url),
            ledger_url=self._via(host, spec.ledger_url),
            pause_s=HOLD_S if host.index == CUT_HOST else spec.pause_s,
        )
        path = self.directory / f"spec-{slot}-{self._spawned}.json"
        process = HostProcess(host, spec, path, self._logs[host.index])
        if process.pid is not None:
            self.pid_host[process.pid] = host.index
        return process

    def _via(self, host: Host, url: str) -> str:
        server, port = _upstream(url)
        return _through(url, host.endpoint(f"{server}:{port}"))

    def tick(self, tally: Tally, applied: int, target: int) -> bool:
        """Cut host 1 when it is due, bring it back ``cut_s`` later; whether the cut is over
        (a run is not done while a host is still off the network)."""
        now = time.time()
        if self.cut_from_s is None:
            holding = any(
                d.end_s is None and self.pid_host.get(d.pid) == CUT_HOST for d in tally.deliveries
            )
            # Held: a handler under way there (its pause makes that most of the time); the
            # second condition only stops a run whose host 1 never gets a message from going
            # uncut.
            if (applied * 3 >= target and holding) or applied * 10 >= target * 9:
                self.hosts[CUT_HOST - 1].cut()
                self.cut_from_s = now
        elif self.cut_to_s is None and now - self.cut_from_s >= self.cut_s:
            self.hosts[CUT_HOST - 1].restore()
            self.cut_to_s = now
        return self.cut_to_s is not None

    def cut_pids(self) -> set[int]:
        """Every process that ran on the cut host."""
        return {pid for pid, index in self.pid_host.items() if index == CUT_HOST}
