"""A TCP forwarder whose connections can fall *silent*: bytes vanish, nothing is closed.

What a dropped packet, a dead NAT entry or a half-dead pooled connection looks like to a client:
its request is sent (the kernel takes it), no answer ever comes, no reset, no FIN. A client
without a socket or statement timeout waits forever. :class:`CuttableProxy` (``_proxy.py``)
closes connections instead, which every driver notices at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_CHUNK = 65536


class SilentProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``.

    :meth:`silence_all` drops every byte both ways on every connection, new ones too (a
    partition with packets vanishing); :meth:`silence_next` makes the first connection whose
    client sends ``pattern`` silent from that moment on (one pooled connection gone quiet mid
    statement); :meth:`heal` ends the silent connections (as the kernel would, much later) and
    forwards again.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._all_silent = False
        self._pattern: bytes | None = None
        self._silent: set[int] = set()  # ids of silenced connections
        self._pairs: dict[int, tuple[socket.socket, socket.socket]] = {}
        self._closed = False
        self.silenced = threading.Event()  # set once a connection went silent
        threading.Thread(target=self._accept, daemon=True).start()

    def silence_all(self) -> None:
        with self._lock:
            self._all_silent = True
            self._silent.update(self._pairs)
        self.silenced.set()

    def silence_next(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = pattern

    def heal(self) -> None:
        with self._lock:
            self._all_silent = False
            self._pattern = None
            dead = [self._pairs.pop(conn) for conn in self._silent if conn in self._pairs]
            self._silent.clear()
        for pair in dead:
            for sock in pair:
                _close(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        _close(self._listener)
        for pair in pairs:
            for sock in pair:
                _close(sock)

    def _accept(self) -> None:
        conn_id = 0
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            conn_id += 1
            with self._lock:
                if self._closed:
                    _close(client)
                    _close(server)
                    return
                self._pairs[conn_id] = (client, server)
                if self._all_silent:
                    self._silent.add(conn_id)
            for src, dst, outbound in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pump, args=(conn_id, src, dst, outbound), daemon=True
                ).start()

    def _pump(self, conn_id: int, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while chunk := src.recv(_CHUNK):
                with self._lock:
                    if outbound and self._pattern is not None and self._pattern in chunk:
                        self._pattern = None
                        self._silent.add(conn_id)
                        self.silenced.set()
                    silent = conn_id in self._silent
                if not silent:
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pairs.pop(conn_id, None)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
