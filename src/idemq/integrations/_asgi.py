"""The ASGI plumbing of :mod:`idemq.integrations.asgi`: the protocol's types, the response
held back while the guard decides, the request body handed to the app again, the scope the app
sees (with the dedup transaction in its ``state``)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

__all__ = [
    "TX_STATE_KEY",
    "ASGIApp",
    "Capture",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "app_scope",
    "maybe_await",
    "replaying",
    "respond",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TX_STATE_KEY = "idemq_tx"
"""``scope["state"][TX_STATE_KEY]`` (Starlette: ``request.state.idemq_tx``): the SQLAlchemy
``AsyncConnection`` of the dedup transaction while a guarded request runs in transactional
mode; None in lease mode."""

# Extensions that let an app send a response without its bytes passing through ``send``
# (a file by path): a guarded response must pass through, to be stored.
_BYPASS_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


class Capture:
    """The app's response, held back until the guard has decided (committed or rolled back)."""

    __slots__ = ("body", "headers", "max_bytes", "size", "status", "unstorable")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.unstorable: str | None = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", ())]
            if message.get("trailers"):
                self.unstorable = "the response has trailers, which are not stored for replay"
        elif kind == "http.response.body":
            chunk = bytes(message.get("body", b""))
            self.size += len(chunk)
            if self.size > self.max_bytes:
                self.body.clear()  # past the limit nothing more is kept in memory
            else:
                self.body.append(chunk)
        elif kind != "http.response.trailers":
            self.unstorable = f"the app sent {kind!r}, which cannot be stored for replay"

    def joined(self) -> bytes:
        return b"".join(self.body)


def app_scope(scope: Scope, tx: Any) -> Scope:
    """The scope the app sees: ``state`` carries the transaction; no extension that would let
    a response bypass ``send``. A copy: the server's scope and its shared state stay as they
    were."""
    inner = dict(scope)
    inner["state"] = {**scope.get("state", {}), TX_STATE_KEY: tx}
    extensions = scope.get("extensions")
    if extensions and any(name in extensions for name in _BYPASS_EXTENSIONS):
        inner["extensions"] = {k: v for k, v in extensions.items() if k not in _BYPASS_EXTENSIONS}
    return inner


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's own
    ``receive`` (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def respond(
    send: Send, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
