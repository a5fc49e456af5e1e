"""Several "hosts" on one machine: network namespaces of their own, joined to the root namespace
by veth pairs, each reaching the real services through forwarders on the root side.

::

    namespace idq<run>1, 10.a.b.2 --veth-- root side 10.a.b.1: forwarder :p1 -> 127.0.0.1:5432
                                                               forwarder :p2 -> 127.0.0.1:5672
    namespace idq<run>2, 10.a.b.6 --veth-- root side 10.a.b.5: ...

A process started with :meth:`Host.command` sees only its namespace's loopback and veth: the
services on 127.0.0.1 of the machine are out of its reach except through its forwarders, so
:meth:`Host.cut` (``ip link set <veth> down``) takes it off the network the way a pulled cable
does: packets vanish, nobody is told, TCP retransmits until the link comes back.

The forwarders are plain relays: they never decide that a host is dead. The servers find out
the way they would without them, through their own timers (a RabbitMQ heartbeat, PostgreSQL's
``idle_in_transaction_session_timeout``), because a forwarder passes silence on as silence.

Used by ``idemq chaos --hosts N`` and by ``tests/hosts``. Needs root (``CAP_NET_ADMIN``) and
iproute2's ``ip``; :func:`probe_namespaces` says why not where they cannot be made. Safety: the
namespaces' addresses are a free ``10.x.y.0/28`` that exists only inside this machine, and the
forwarders connect to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from idemq.chaos.proxy import loopback_only
from idemq.chaos.worker import WorkerSpec
from idemq.errors import ConfigurationError

__all__ = [
    "Forwarder",
    "Host",
    "HostProcess",
    "NamespacesUnavailable",
    "hosts",
    "probe_namespaces",
]

_CHUNK = 65536


class NamespacesUnavailable(ConfigurationError):
    """Network namespaces cannot be made here (not root, no ``ip``, a sandbox refusing it)."""


def _ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)
    except FileNotFoundError as exc:
        raise NamespacesUnavailable("the `ip` command (iproute2) is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise NamespacesUnavailable(
            f"`ip {' '.join(args)}` failed: {exc.stderr.strip() or exc.returncode}"
        ) from exc


def probe_namespaces() -> str | None:
    """None if a network namespace and a veth pair can be made and removed here, else why not."""
    name = f"idq{secrets.token_hex(3)}p"
    try:
        _ip("netns", "add", name)
        try:
            _ip("link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n")
            _ip("link", "set", f"{name}n", "netns", name)
        finally:
            with contextlib.suppress(NamespacesUnavailable):
                _ip("netns", "del", name)
            with contextlib.suppress(NamespacesUnavailable):
                _ip("link", "del", f"{name}h")
    except NamespacesUnavailable as exc:
        return str(exc)
    return None


class Forwarder:
    """Relays ``<listen_host>:<port>`` to ``upstream`` (on 127.0.0.1), byte for byte, until
    :meth:`close`; a connection ends when either side ends it, never because it fell silent.

    :meth:`admits` is asked before each new connection is relayed (a subclass may refuse, as a
    test's cuttable proxy does), and :meth:`drop_connections` ends every relayed one."""

    def __init__(self, upstream: tuple[str, int], *, listen_host: str = "127.0.0.1") -> None:
        self.upstream = (loopback_only(upstream[0]), upstream[1])
        self._listener = socket.create_server((listen_host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="idemq-forwarder").start()

    def admits(self) -> bool:
        """Whether a new connection is relayed now (else it is closed at once)."""
        return True

    def drop_connections(self) -> None:
        """End every relayed connection (new ones are still accepted)."""
        with self._lock:
            for sock in list(self._sockets):
                self._close(sock)

    def close(self) -> None:
        """Stop listening and end every relayed connection."""
        self._closed.set()
        self._listener.close()
        self.drop_connections()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self.admits():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            # The timeout was for connecting: a pooled connection may sit idle for long, and a
            # relay that closed it after 5 s of silence would be an outage nobody asked for.
            server.settimeout(None)
            with self._lock:
                self._sockets.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(_CHUNK):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._close(src)
                self._close(dst)

    def _close(self, sock: socket.socket) -> None:
        self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


@dataclass
class Host:
    """One namespace: its veth (root side), addresses and forwarders, by service name."""

    index: int
    netns: str
    veth: str  # the root side; down = the host is off the network
    address: str  # the host's own address (namespace side)
    gateway: str  # the root side's address, where its forwarders listen
    forwarders: dict[str, Forwarder] = field(default_factory=dict)

    def endpoint(self, service: str) -> str:
        """``gateway:port`` of the forwarder to ``service``, as this host must dial it."""
        return f"{self.gateway}:{self.forwarders[service].port}"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs it: the process
        keeps the pid the caller sees)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self) -> None:
        """Take the host off the network: its veth goes down, in flight bytes are lost."""
        _ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        """Plug the host back in; its connections that survived carry on."""
        _ip("link", "set", self.veth, "up")


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/28 (room for four /30s) that no address of the machine falls in."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    used = [ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", shown)]
    for _ in range(100):
        net = ipaddress.IPv4Network(
            f"10.{secrets.randbelow(180) + 64}.{secrets.randbelow(256)}.0/28"
        )
        if not any(net.overlaps(other) for other in used):
            return net
    raise NamespacesUnavailable("no free 10.x.y.0/28 found for the hosts")


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL what still runs in ``netns`` (only processes started there by this module's
    caller live there)."""
    result = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10, check=False
    )
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


MAX_HOSTS = 4
"""Hosts per run: four /30 links fit the /28 a run takes."""


@contextlib.contextmanager
def hosts(count: int, services: dict[str, tuple[str, int]]) -> Iterator[list[Host]]:
    """``count`` hosts, each with a forwarder to every ``services`` upstream; all removed on exit
    (namespaces, veths, forwarders, and anything left running inside), failure or not."""
    if not 1 <= count <= MAX_HOSTS:
        raise ConfigurationError(f"hosts must be 1 to {MAX_HOSTS}, got {count}")
    run = secrets.token_hex(3)
    subnet = _free_subnet()
    links = list(subnet.subnets(new_prefix=30))
    made: list[Host] = []
    try:
        for index in range(1, count + 1):
            gateway, address = (str(a) for a in list(links[index - 1].hosts())[:2])
            host = Host(index, f"idq{run}{index}", f"idq{run}{index}h", address, gateway)
            made.append(host)
            peer = f"idq{run}{index}n"
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("addr", "add", f"{gateway}/30", "dev", host.veth)
            _ip("link", "set", host.veth, "up")
            _ip("-n", host.netns, "addr", "add", f"{address}/30", "dev", peer)
            _ip("-n", host.netns, "link", "set", peer, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            for name, upstream in services.items():
                host.forwarders[name] = Forwarder(upstream, listen_host=gateway)
        _wait_links_up(made)
        yield made
    finally:
        for host in made:
            for forwarder in host.forwarders.values():
                forwarder.close()
            _kill_namespace_processes(host.netns)
            with contextlib.suppress(NamespacesUnavailable):
                _ip("netns", "del", host.netns)
            with contextlib.suppress(NamespacesUnavailable):
                _ip("link", "del", host.veth)  # gone with its namespace, unless a process held it


def _wait_links_up(made: list[Host], timeout_s: float = 10.0) -> None:
    """Block until each host can reach its gateway (a fresh veth takes a moment to carry)."""
    deadline = time.monotonic() + timeout_s
    for host in made:
        if not host.forwarders:
            continue
        gateway, port = host.endpoint(next(iter(host.forwarders))).split(":")
        probe = f"import socket; socket.create_connection(({gateway!r}, {port}), timeout=1).close()"
        while True:
            done = subprocess.run(
                host.command([sys.executable, "-c", probe]), capture_output=True, check=False
            )
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise NamespacesUnavailable(f"host {host.index} cannot reach {gateway}:{port}")
            time.sleep(0.2)


class HostProcess:
    """A chaos process (:func:`idemq.chaos.worker.run_from_file`) running inside ``host``, with
    the handle the supervisor uses for its forkserver processes (``pid``, ``is_alive``,
    ``join``, ``kill``). Its spec travels as a JSON file; its output goes to ``log``."""

    def __init__(self, host: Host, spec: WorkerSpec, spec_path: Path, log: IO[bytes]) -> None:
        spec_path.write_text(json.dumps(asdict(spec)))
        program = (
            "import sys; from idemq.chaos.worker import run_from_file; run_from_file(sys.argv[1])"
        )
        argv = [sys.executable, "-c", program, str(spec_path)]
        self.host = host
        self._popen = subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT)
        self.pid: int | None = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        self._popen.kill()
