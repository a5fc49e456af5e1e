"""The HTTP ``Idempotency-Key`` rules with no I/O and no framework: what the ASGI middleware
(:mod:`idemq.integrations.asgi`) and a WSGI/Django middleware share.

Following draft-ietf-httpapi-idempotency-key-header (the ``Idempotency-Key`` request header, an
RFC 8941 structured-field String) and RFC 9457 problem details:

* :func:`parse_key` — the header's value as the client's key, or :class:`InvalidMessageIdError`
  saying why it is not one;
* :func:`scope_token` and :func:`dedup_id` — the dedup record's id: the key inside the scope of
  the client that sent it, so two clients' equal keys never meet;
* :func:`request_fingerprint` — method, target and body digest: the same key sent with another
  request is refused (422) rather than answered with the first request's response;
* :class:`StoredResponse` — what is kept of a response for replay (status, the headers that
  describe the result, body), and how it is stored in the dedup record;
* :class:`Problem` — the error responses (400, 409, 413, 422, 500, 503).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from idemq.errors import ConfigurationError, InvalidMessageError, InvalidMessageIdError
from idemq.guard.core import MAX_MESSAGE_ID_CHARS

__all__ = [
    "DEFAULT_METHODS",
    "DEFAULT_STORED_STATUSES",
    "KEY_HEADER",
    "MAX_KEY_CHARS",
    "REPLAYED_HEADER",
    "WHOLE_APP",
    "Problem",
    "StoredResponse",
    "check_key",
    "dedup_id",
    "parse_key",
    "request_fingerprint",
    "scope_token",
    "stored_statuses",
]

KEY_HEADER = b"idempotency-key"
"""The request header (lower case, as ASGI hands header names over)."""

REPLAYED_HEADER = b"idempotent-replayed"
"""The response header that marks a replay (Stripe's convention; the draft defines none)."""

DEFAULT_METHODS = ("POST", "PATCH")

WHOLE_APP = "*"
"""The scope token of a request without credentials: keys are shared by the whole app."""

_TOKEN_CHARS = 32  # hex digits of a scope's SHA-256 kept in the dedup id: 128 bits
MAX_KEY_CHARS = MAX_MESSAGE_ID_CHARS - _TOKEN_CHARS - 1
"""The longest key a dedup id can hold after its scope token and the ``:`` (95)."""

# Statuses a client answers by trying again: storing one would answer every retry with it.
_RETRY_STATUSES = frozenset({408, 409, 425, 429})
DEFAULT_STORED_STATUSES = frozenset(
    s for s in range(200, 500) if s not in _RETRY_STATUSES and not 300 <= s < 400
) | frozenset({301, 302, 303, 307, 308})
"""2xx, the redirects a form's POST answers with, and 4xx except 408, 409, 425 and 429."""

# Never replayed: hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the result;
# Date and Server are the server's own; Content-Length is recomputed from the stored body; and a
# Set-Cookie is a credential that must not rest in the dedup store or reach a second response.
_NEVER_STORED = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"server",
        b"content-length",
        b"set-cookie",
        REPLAYED_HEADER,
    }
)


def stored_statuses(statuses: Iterable[int] | None) -> frozenset[int]:
    """The statuses whose responses are stored (``None``: :data:`DEFAULT_STORED_STATUSES`).

    A 5xx cannot be stored: it says the request did not complete, and a stored one would answer
    every retry with the failure."""
    if statuses is None:
        return DEFAULT_STORED_STATUSES
    chosen = frozenset(statuses)
    bad = sorted(s for s in chosen if not (isinstance(s, int) and 100 <= s < 500))
    if bad:
        raise ConfigurationError(f"stored_statuses must be 100-499, got {bad}")
    return chosen


# -- the key ---------------------------------------------------------------------------------


def parse_key(raw: bytes) -> str:
    """The String in an ``Idempotency-Key`` field value (RFC 8941 §4.2: an Item whose bare
    item is an sf-string; parameters are parsed and ignored, as the RFC says of unknown ones).

    Raises :class:`InvalidMessageIdError` saying what is wrong: not a quoted string, a
    character outside printable ASCII, a bad escape, or something after the item (two header
    lines arrive joined by a comma, and the draft allows one).
    """
    text = _ascii(raw)
    pos = _skip(text, 0, " ")
    key, pos = _sf_string(text, pos)
    pos = _parameters(text, pos)
    pos = _skip(text, pos, " ")
    if pos != len(text):
        raise InvalidMessageIdError(
            f"Idempotency-Key has {text[pos : pos + 10]!r} after the key; send one key, once"
        )
    return key


def check_key(key: str, max_key_chars: int) -> str:
    """``key`` if a dedup id can be made of it: non-empty and at most ``max_key_chars``."""
    if not key:
        raise InvalidMessageIdError("Idempotency-Key is empty")
    if len(key) > max_key_chars:
        raise InvalidMessageIdError(
            f"Idempotency-Key has {len(key)} characters, the maximum is {max_key_chars}"
        )
    return key


def _ascii(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise InvalidMessageIdError("Idempotency-Key is not ASCII") from exc


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _sf_string(text: str, pos: int) -> tuple[str, int]:
    """RFC 8941 §4.2.5: ``"`` *( unescaped / ``\\"`` / ``\\\\`` ) ``"``."""
    if pos >= len(text) or text[pos] != '"':
        raise InvalidMessageIdError(
            'Idempotency-Key must be a quoted string (RFC 8941), e.g. "8e03978e-40d5-43e8"'
        )
    out: list[str] = []
    pos += 1
    while pos < len(text):
        char = text[pos]
        pos += 1
        if char == "\\":
            if pos >= len(text) or text[pos] not in '"\\':
                raise InvalidMessageIdError('Idempotency-Key: only \\" and \\\\ may be escaped')
            out.append(text[pos])
            pos += 1
        elif char == '"':
            return "".join(out), pos
        elif not " " <= char <= "~":
            raise InvalidMessageIdError(
                f"Idempotency-Key contains {char!r}: only printable ASCII is allowed"
            )
        else:
            out.append(char)
    raise InvalidMessageIdError("Idempotency-Key has no closing quote")


_KEY_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz*")
_KEY_CHARS = _KEY_FIRST | frozenset("0123456789_-.")
_TOKEN_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz*")
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789:/") | _TOKEN_FIRST
_NUMBER = frozenset("0123456789.-")
_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _parameters(text: str, pos: int) -> int:
    """RFC 8941 §4.2.3.2: ``*( ";" *SP key [ "=" bare-item ] )``; returns where they end."""
    while pos < len(text) and text[pos] == ";":
        pos = _skip(text, pos + 1, " ")
        if pos >= len(text) or text[pos] not in _KEY_FIRST:
            raise InvalidMessageIdError("Idempotency-Key has a malformed parameter")
        pos = _skip(text, pos, "".join(_KEY_CHARS))
        if pos < len(text) and text[pos] == "=":
            pos = _bare_item(text, pos + 1)
    return pos


def _bare_item(text: str, pos: int) -> int:
    """Skip one bare item (string, byte sequence, boolean, number, token, date)."""
    char = text[pos] if pos < len(text) else ""
    if char == '"':
        return _sf_string(text, pos)[1]
    end = pos + 1
    if char == ":":
        end = _skip(text, end, "".join(_BASE64))
        if end >= len(text) or text[end] != ":":
            raise InvalidMessageIdError("Idempotency-Key has a malformed byte sequence")
        return end + 1
    if char == "?" and text[end : end + 1] in ("0", "1"):
        return end + 1
    if char == "@" or (char in _NUMBER and char != "."):  # a date is "@" then an integer
        return _skip(text, end, "".join(_NUMBER))
    if char in _TOKEN_FIRST:
        return _skip(text, end, "".join(_TCHARS))
    raise InvalidMessageIdError("Idempotency-Key has a malformed parameter value")


# -- the dedup id ----------------------------------------------------------------------------


def scope_token(scope: str | bytes | None) -> str:
    """The part of the dedup id that says whose key it is: :data:`WHOLE_APP` for ``None``,
    else 32 hex digits of the SHA-256 of the scope's value (credentials are never stored)."""
    if scope is None:
        return WHOLE_APP
    data = scope.encode("utf-8", "surrogatepass") if isinstance(scope, str) else scope
    return hashlib.sha256(data).hexdigest()[:_TOKEN_CHARS]


def dedup_id(token: str, key: str) -> str:
    """``token:key``. The token is ``*`` or a fixed number of hex digits, so no two (scope, key)
    pairs make the same id: a key cannot pose as another client's."""
    return f"{token}:{key}"


def request_fingerprint(method: str, path: str, query: bytes, body: bytes) -> str:
    """What makes a retry the same request: method, path, query string and the body's SHA-256.

    The guard stores its hash with the record; the same key with another fingerprint is a
    client reusing a key for a new request (422), never answered with the first one's response.
    """
    digest = hashlib.sha256(body).hexdigest()
    return f"{method} {path}?{query.decode('latin-1')} sha256:{digest}"


# -- responses -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as the dedup record keeps it: status, the headers kept for replay
    (lower-case names, in order), body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @classmethod
    def of(cls, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> StoredResponse:
        """The part of a response that is stored: hop-by-hop headers, headers the
        ``Connection`` header names, Date, Server, Content-Length and Set-Cookie are dropped."""
        named_by_connection = {
            token.strip().lower().encode("latin-1")
            for name, value in headers
            if name.lower() == b"connection"
            for token in value.decode("latin-1").split(",")
        }
        kept = tuple(
            (name.lower(), value)
            for name, value in headers
            if name.lower() not in _NEVER_STORED and name.lower() not in named_by_connection
        )
        return cls(status, kept, body)

    def to_result(self) -> dict[str, Any]:
        """The JSON form kept as the guard's result (headers as latin-1, body as base64)."""
        return {
            "v": 1,
            "status": self.status,
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in self.headers],
            "body": base64.b64encode(self.body).decode("ascii"),
        }

    @classmethod
    def from_result(cls, result: object) -> StoredResponse:
        """Read back :meth:`to_result`; a record this module did not write is refused
        (:class:`InvalidMessageError`) rather than replayed as something it is not."""
        try:
            if not isinstance(result, dict) or result.get("v") != 1:
                raise ValueError("not a stored response")  # noqa: TRY301
            headers = tuple(
                (str(n).encode("latin-1"), str(v).encode("latin-1")) for n, v in result["headers"]
            )
            return cls(int(result["status"]), headers, base64.b64decode(result["body"]))
        except (AssertionError, KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise InvalidMessageError(
                "the dedup record's result is not a stored HTTP response (was this key used "
                "by another consumer?)"
            ) from exc

    def replay_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers of a replay: the stored ones, Content-Length, ``Idempotent-Replayed``."""
        return [
            *self.headers,
            (b"content-length", str(len(self.body)).encode("ascii")),
            (REPLAYED_HEADER, b"true"),
        ]


@dataclass(frozen=True, slots=True)
class Problem:
    """An RFC 9457 problem details response. ``code`` is an extension member that tells the
    problems apart for a program (the ``type`` is ``about:blank`` unless the app gives a base
    URI, so ``title`` is the status phrase as RFC 9457 §4.2.1 asks)."""

    status: int
    title: str
    code: str
    detail: str

    def body(self, type_base: str | None = None) -> bytes:
        """The ``application/problem+json`` body (``type``: ``type_base`` + ``code``)."""
        document = {
            "type": "about:blank" if type_base is None else type_base + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        return json.dumps(document).encode("utf-8")

    def headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        """Content-Type and Content-Length of :meth:`body`."""
        return [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
        ]

    @classmethod
    def missing_key(cls) -> Problem:
        return cls(
            400,
            "Bad Request",
            "idempotency-key-missing",
            "this operation requires an Idempotency-Key header",
        )

    @classmethod
    def invalid_key(cls, why: str) -> Problem:
        return cls(400, "Bad Request", "idempotency-key-invalid", why)

    @classmethod
    def in_flight(cls) -> Problem:
        return cls(
            409,
            "Conflict",
            "idempotency-key-in-flight",
            "a request with this Idempotency-Key is still being processed; retry later with "
            "the same key to get its response",
        )

    @classmethod
    def reused(cls) -> Problem:
        return cls(
            422,
            "Unprocessable Content",
            "idempotency-key-reused",
            "this Idempotency-Key was used with another request (method, path, query or "
            "body differ); use a new key for a new request",
        )

    @classmethod
    def request_too_large(cls, max_bytes: int) -> Problem:
        return cls(
            413,
            "Content Too Large",
            "request-too-large",
            f"a request with an Idempotency-Key may have at most {max_bytes} body bytes",
        )

    @classmethod
    def response_too_large(cls, max_bytes: int) -> Problem:
        return cls(
            500,
            "Internal Server Error",
            "response-too-large",
            f"the response was larger than the {max_bytes} bytes that can be stored for "
            "replay; nothing was stored and the request's transaction was rolled back",
        )

    @classmethod
    def unstorable(cls, why: str) -> Problem:
        return cls(500, "Internal Server Error", "response-not-storable", why)

    @classmethod
    def store_unavailable(cls) -> Problem:
        return cls(
            503,
            "Service Unavailable",
            "idempotency-store-unavailable",
            "the idempotency store could not be reached; retry later with the same key",
        )
