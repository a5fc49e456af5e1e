"""Record keys: ``<prefix>:{<consumer>:<message_id>}``, hash-tagged and percent-encoded.

Message ids are arbitrary text. A raw ``}`` would end the Cluster hash tag early, a raw ``:``
would make ``("a:b", "c")`` and ``("a", "b:c")`` the same key, and a raw ``*``/``?``/``[`` would
turn a SCAN pattern into a wildcard that reads (or a purge that deletes) other messages' records.
After encoding, a key part holds only ``[A-Za-z0-9_.~-]`` and ``%XX``, so it is exact, reversible
and glob-inert; patterns are glob-escaped anyway as a second line of defence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from idemq.drivers.redis import text
from idemq.errors import ConfigurationError
from idemq.stores.base import Key

_GLOB_SPECIALS = frozenset("*?[]\\")


def glob_escape(value: str) -> str:
    """``value`` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + ch if ch in _GLOB_SPECIALS else ch for ch in value)


_RESERVED_ASCII = re.compile(r"[^A-Za-z0-9_.~-]")
"""What ``quote(safe="")`` escapes in an ASCII string (its safe set is exactly the complement)."""


_PERCENT = {chr(c): f"%{c:02X}" for c in range(128)}
"""An ASCII character's escape as ``quote()`` writes it (looked up: half the cost of formatting)."""


def _percent(match: re.Match[str]) -> str:
    return _PERCENT[match[0]]


_RESERVED_BUT_COLON = re.compile(r"[^A-Za-z0-9_.~:-]")


def _encode_part(value: str) -> str:
    # The common cases, ASCII ids, take one regex pass: typical ids (ORDER_…_NODE01_0001) have
    # nothing to escape, and ids joined by ":" (topic:partition:offset) only that, which one
    # replace does at a quarter of the cost of a callback per colon. Any other character to
    # escape costs a callback, still far less than quote()'s byte-by-byte loop. All three give
    # exactly what quote() gives, so every record keeps its key.
    if value.isascii():
        if _RESERVED_BUT_COLON.search(value) is None:
            return value.replace(":", "%3A")
        return _RESERVED_ASCII.sub(_percent, value)
    # safe="" also escapes "/", leaving only unreserved characters: no glob, brace or colon.
    return quote(value, safe="", encoding="utf-8", errors="surrogatepass")


def _decode_part(value: str) -> str:
    return unquote(value, encoding="utf-8", errors="surrogatepass")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a store's records live and how long they are kept."""

    prefix: str
    ttl_ms: int
    # consumer → "<prefix>:{<encoded consumer>:": a guard has one consumer, so a claim's key is
    # this head, the encoded id and "}" (consumers are configuration: the dict stays small).
    _heads: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, prefix: str, ttl_s: float) -> Layout:
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            # A brace in the prefix would become the hash tag and put every record in one slot.
            raise ConfigurationError(f"prefix must be a non-empty str without braces: {prefix!r}")
        if not ttl_s > 0:
            raise ConfigurationError(f"ttl_s must be positive, got {ttl_s!r}")
        return cls(prefix, round(ttl_s * 1000))

    def key(self, key: Key) -> str:
        head = self._heads.get(key.consumer)
        if head is None:
            head = self._heads[key.consumer] = f"{self.prefix}:{{{_encode_part(key.consumer)}:"
        return f"{head}{_encode_part(key.message_id)}}}"

    def key_arg(self, key: Key) -> bytes:
        """:meth:`key` as a command argument (see :func:`_arg`)."""
        return self.key(key).encode()

    def parse_key(self, raw: bytes | str) -> Key | None:
        """The :class:`Key` of a record key found by SCAN, or ``None`` if it is not ours."""
        name = text(raw)
        head = f"{self.prefix}:{{"
        if not (name.startswith(head) and name.endswith("}")):
            return None
        consumer, sep, message_id = name[len(head) : -1].partition(":")
        if not sep or ":" in message_id:
            return None
        return Key(_decode_part(consumer), _decode_part(message_id))

    def pattern_all(self) -> str:
        return f"{glob_escape(self.prefix)}:{{*}}"

    def pattern_message(self, message_id: str) -> str:
        return f"{glob_escape(self.prefix)}:{{*:{glob_escape(_encode_part(message_id))}}}"
