"""What a URL names, and how it may be shown: in logs, error messages and reprs, never with a
secret in them.

Every store, broker and worker URL can carry credentials (``redis://:pw@host``,
``amqp://guest:pw@host``, ``nats://token@host``). A URL that reaches a log line or an exception
message goes through :func:`mask_url` first, so a password cannot leak into log aggregation
or a bug report.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["is_redis_url", "mask_url"]

_MASK = "***"

_REDIS_SCHEMES = frozenset({"redis", "rediss", "unix"})


def is_redis_url(url: str) -> bool:
    """True for a URL redis-py connects to (``redis://``, ``rediss://``, ``unix://``, in any
    case): every place that takes "a Redis URL or an SQLAlchemy URL" tells them apart here."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in _REDIS_SCHEMES


def mask_url(url: str) -> str:
    """``url`` with its secret replaced by ``***``; never raises, whatever ``url`` holds.

    One rule everywhere: the user name is shown, the secret is hidden. ``user:password@`` becomes
    ``user:***@``, a password-only ``:password@`` becomes ``:***@``, and a lone ``user@`` is shown
    as it is: it names who connects and holds no secret. The one exception is a NATS URL, whose
    lone ``token@`` *is* the secret (nats-py reads it as the auth token): it becomes ``***@``.
    A URL that cannot be parsed is not echoed back at all.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host
        return "<unparsable URL>"
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        if "@" in url and "://" not in url:
            # No "//", so no netloc was found: "user:pw@host/db" parses as scheme "user" and
            # path "pw@host/db". Mask the secret before the "@" rather than echo a password.
            userinfo, _, rest = url.rpartition("@")
            return f"{_masked_userinfo(userinfo, token_alone=False)}@{rest}"
        return url
    token_alone = parts.scheme.lower() in _TOKEN_SCHEMES
    credentials = _masked_userinfo(userinfo, token_alone=token_alone)
    return urlunsplit(parts._replace(netloc=f"{credentials}@{host}"))


# Schemes whose lone userinfo ("scheme://x@host") is a secret token, not a user name.
_TOKEN_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})


def _masked_userinfo(userinfo: str, *, token_alone: bool) -> str:
    user, colon, _secret = userinfo.partition(":")
    if colon:
        return f"{user}:{_MASK}"
    return _MASK if token_alone else user
