"""A TCP forwarder the tests can cut: a real network outage in front of a real database."""

from __future__ import annotations

import threading

from idemq.chaos.hosts import Forwarder


class CuttableProxy(Forwarder):
    """Forwards 127.0.0.1:<port> to ``upstream``; :meth:`cut` drops every connection and refuses
    new ones until :meth:`restore` (connections are accepted, then closed at once)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._cut = threading.Event()  # before the forwarder's accept thread asks admits()
        super().__init__(upstream)

    def admits(self) -> bool:
        return not self._cut.is_set()

    def cut(self) -> None:
        self._cut.set()
        self.drop_connections()

    def restore(self) -> None:
        self._cut.clear()
