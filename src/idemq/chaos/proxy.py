"""A fault-injecting TCP proxy: cause 1 of duplicates (partition → confirm timeout → retry).

The producer talks to the broker through this proxy. :meth:`FaultProxy.partition` opens a window
during which **client→broker bytes still flow but broker→client bytes are dropped** — the
asymmetric half-partition that makes a publish land on the broker while its confirm never comes
back. The publisher's confirm times out and it retries with the same id: the broker now holds
the message twice, exactly as in production.

Dropping bytes mid-stream would desynchronise the protocol (AMQP frames, RESP, NATS ops), so
when the window ends every connection that lost bytes is reset, as a real partition outlasting
the heartbeat would; clients reconnect (new connections made *during* the window are
half-partitioned too, so a retry inside the window duplicates again — also real).

A partition can spare some connections: with ``victim`` set, only connections whose bytes from
the client contained it are cut (Kafka: every client goes through the proxy, since it is the
broker's advertised listener, but only the producer — found by its ``client.id``, which every
Kafka request carries — must lose its replies).

Safety: the proxy listens on and connects to ``127.0.0.1`` only (:func:`loopback_only`); it
runs its own event loop in a daemon thread and stops with :meth:`close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Callable

from idemq.errors import ConfigurationError

__all__ = ["FaultProxy", "loopback_only"]

_CHUNK = 65536


def loopback_only(host: str) -> str:
    """Return ``host`` if it is 127.0.0.1 (or ``localhost``); refuse anything else.

    A chaos tool that cuts connections must never be pointed at someone else's server.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigurationError(
            f"the chaos proxy only connects to 127.0.0.1, not {host!r}"
        ) from exc
    if address != ipaddress.ip_address("127.0.0.1"):
        raise ConfigurationError(f"the chaos proxy only connects to 127.0.0.1, not {host!r}")
    return "127.0.0.1"


class _Link:
    """One proxied connection; ``tainted`` once a broker→client byte was dropped."""

    def __init__(
        self, client: asyncio.StreamWriter, server: asyncio.StreamWriter, *, victim: bool
    ) -> None:
        self.client = client
        self.server = server
        self.victim = victim  # partitions cut this connection
        self.tainted = False

    def reset(self) -> None:
        for writer in (self.client, self.server):
            transport = writer.transport
            if not transport.is_closing():
                transport.abort()  # RST, not FIN: the peer must not mistake it for a clean close


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``; can half-partition.

    ``listen_port`` 0 picks a free port. ``victim``: partition only connections whose client
    bytes contained it (None: every connection). ``clock_s`` is injected so tests of the
    window logic need no sleeping.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_port: int = 0,
        victim: bytes | None = None,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = (loopback_only(upstream_host), upstream_port)
        self._listen_port = listen_port
        self._victim = victim
        self._clock_s = clock_s
        self._until_s = 0.0
        self._links: set[_Link] = set()
        self.partitions = 0
        self.dropped_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="idemq-chaos-proxy")
        self._thread.daemon = True
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        sock: socket.socket = self._server.sockets[0]
        self.port: int = sock.getsockname()[1]

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>`` for the producer's URL."""
        return f"127.0.0.1:{self.port}"

    def partitioned(self) -> bool:
        """Whether a window is open now."""
        return self._clock_s() < self._until_s

    def partition(self, window_s: float) -> None:
        """Drop broker→client bytes for ``window_s`` seconds, then reset the connections hit."""
        self._until_s = self._clock_s() + window_s
        self.partitions += 1
        self._loop.call_soon_threadsafe(self._loop.call_later, window_s, self._heal)

    def close(self) -> None:
        """Reset every connection, stop listening and stop the loop thread."""
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            self._server.close()
            for link in list(self._links):
                link.reset()
            # Let the reset connections' pumps see the reset and end (Kafka's consumers go
            # through the proxy too), rather than die as "task destroyed but pending".
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    # -- loop thread -------------------------------------------------------------------------

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._accept, "127.0.0.1", self._listen_port)

    def _heal(self) -> None:
        if self.partitioned():  # a later window extended the partition
            return
        for link in [link for link in self._links if link.tainted]:
            link.reset()
            self._links.discard(link)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, up_writer, victim=self._victim is None)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, link, drops=False),
                self._pump(up_reader, writer, link, drops=True),
            )
        finally:
            self._links.discard(link)
            link.reset()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, link: _Link, *, drops: bool
    ) -> None:
        try:
            while chunk := await src.read(_CHUNK):
                if not (drops or link.victim) and self._victim and self._victim in chunk:
                    link.victim = True  # the client named itself (Kafka: in every request)
                if drops and link.victim and self.partitioned():
                    link.tainted = True
                    self.dropped_bytes += len(chunk)
                    continue
                if drops and link.tainted:
                    continue  # the stream lost bytes: nothing after them can be parsed
                dst.write(chunk)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.reset()
