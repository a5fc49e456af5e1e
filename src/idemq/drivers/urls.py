"""URLs as they may be shown: in logs, error messages and reprs, never with a secret in them.

Every store, broker and worker URL can carry credentials (``redis://:pw@host``,
``amqp://guest:pw@host``, ``nats://token@host``). A URL that reaches a log line or an exception
message goes through :func:`mask_url` first, so a password cannot leak into log aggregation
or a bug report.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["mask_url"]

_MASK = "***"


def mask_url(url: str) -> str:
    """``url`` with its secret replaced by ``***``; never raises, whatever ``url`` holds.

    ``user:password@`` keeps the user (``guest:***@``), a password-only ``:password@`` becomes
    ``:***@``, and a lone ``token@`` (how NATS and some Redis setups pass a token) becomes
    ``***@``. A URL that cannot be parsed is not echoed back at all.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host
        return "<unparsable URL>"
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        if "@" in url and "://" not in url:
            # No "//", so no netloc was found: "user:pw@host/db" parses as scheme "user" and
            # path "pw@host/db". Mask everything before the "@" rather than echo a password.
            return f"{_MASK}@{url.rpartition('@')[2]}"
        return url
    user, colon, _secret = userinfo.partition(":")
    credentials = f"{user}:{_MASK}" if colon else _MASK
    return urlunsplit(parts._replace(netloc=f"{credentials}@{host}"))
