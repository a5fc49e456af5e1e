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

The forwarders are plain relays (:class:`~tests.contract._proxy.CuttableProxy`): they never
decide that a host is dead. The servers find out the way they would without them, through
their own timers (a RabbitMQ heartbeat, PostgreSQL's ``idle_in_transaction_session_timeout``),
because the forwarder passes silence on as silence.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tests.contract._proxy import CuttableProxy

__all__ = ["Host", "NamespacesUnavailable", "hosts", "probe_namespaces"]


class NamespacesUnavailable(Exception):
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


@dataclass
class Host:
    """One namespace: its veth (root side), addresses and forwarders, by service name."""

    index: int
    netns: str
    veth: str  # the root side; down = the host is off the network
    address: str  # the host's own address (namespace side)
    gateway: str  # the root side's address, where its forwarders listen
    forwarders: dict[str, CuttableProxy] = field(default_factory=dict)

    def endpoint(self, service: str) -> str:
        """``gateway:port`` of the forwarder to ``service``, as this host must dial it."""
        return f"{self.gateway}:{self.forwarders[service].port}"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
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
        net = ipaddress.ip_network(
            f"10.{secrets.randbelow(180) + 64}.{secrets.randbelow(256)}.0/28"
        )
        if not any(net.overlaps(other) for other in used):
            return net
    raise NamespacesUnavailable("no free 10.x.y.0/28 found for the hosts")


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL what still runs in ``netns`` (only processes the test started live there)."""
    result = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10, check=False
    )
    for pid in result.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def hosts(count: int, services: dict[str, tuple[str, int]]) -> Iterator[list[Host]]:
    """``count`` hosts, each with a forwarder to every ``services`` upstream; all removed on exit
    (namespaces, veths, forwarders, and anything left running inside), failure or not."""
    run = secrets.token_hex(3)
    subnet = _free_subnet()
    made: list[Host] = []
    try:
        for index in range(1, count + 1):
            pair = list(subnet.subnets(new_prefix=30))[index - 1]
            gateway, address = (str(a) for a in list(pair.hosts())[:2])
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
                host.forwarders[name] = CuttableProxy(upstream, listen_host=gateway)
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
        service = next(iter(host.forwarders))
        gateway, port = host.endpoint(service).split(":")
        probe = f"import socket; socket.create_connection(({gateway!r}, {port}), timeout=1).close()"
        while True:
            done = subprocess.run(
                host.command(["python3", "-c", probe]), capture_output=True, check=False
            )
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise NamespacesUnavailable(f"host {host.index} cannot reach {gateway}:{port}")
            time.sleep(0.2)
