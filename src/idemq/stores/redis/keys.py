"""Record keys: ``<prefix>:{<consumer>:<message_id>}``, hash-tagged and percent-encoded.

Message ids are arbitrary text. A raw ``}`` would end the Cluster hash tag early, a raw ``:``
would make ``("a:b", "c")`` and ``("a", "b:c")`` the same key, and a raw ``*``/``?``/``[`` would
turn a SCAN pattern into a wildcard that reads (or a purge that deletes) other messages' records.
After :func:`~idemq.drivers.redis.escape_key_part`, a key part holds only ``[A-Za-z0-9_.~-]``
and ``%XX``, so it is exact, reversible and glob-inert; patterns are glob-escaped anyway as a
second line of defence.
"""

from __future__ import annotations

from dataclasses import dataclass

from idemq.drivers.redis import escape_key_part, text, unescape_key_part
from idemq.errors import ConfigurationError
from idemq.stores.base import Key

__all__ = ["Layout", "glob_escape"]

_GLOB_SPECIALS = frozenset("*?[]\\")


def glob_escape(value: str) -> str:
    """``value`` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + ch if ch in _GLOB_SPECIALS else ch for ch in value)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a store's records live (``prefix``) and how long a PROCESSED one is kept."""

    prefix: str
    ttl_ms: int

    @classmethod
    def build(cls, prefix: str, ttl_s: float) -> Layout:
        """Validate ``prefix`` and ``ttl_s``; raise :class:`~idemq.ConfigurationError` if bad."""
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            # A brace in the prefix would become the hash tag and put every record in one slot.
            raise ConfigurationError(f"prefix must be a non-empty str without braces: {prefix!r}")
        if not ttl_s > 0:
            raise ConfigurationError(f"ttl_s must be positive, got {ttl_s!r}")
        return cls(prefix=prefix, ttl_ms=round(ttl_s * 1000))

    def key(self, key: Key) -> str:
        """The Redis key of ``key``'s record."""
        consumer = escape_key_part(key.consumer)
        return f"{self.prefix}:{{{consumer}:{escape_key_part(key.message_id)}}}"

    def parse_key(self, raw: bytes | str) -> Key | None:
        """The :class:`Key` of a record key found by SCAN, or ``None`` if it is not ours."""
        name = text(raw)
        head = f"{self.prefix}:{{"
        if not (name.startswith(head) and name.endswith("}")):
            return None
        consumer, sep, message_id = name[len(head) : -1].partition(":")
        if not sep or ":" in message_id:
            return None
        return Key(unescape_key_part(consumer), unescape_key_part(message_id))

    def pattern_all(self) -> str:
        """A SCAN pattern matching every record of this prefix."""
        return f"{glob_escape(self.prefix)}:{{*}}"

    def pattern_message(self, message_id: str) -> str:
        """A SCAN pattern matching ``message_id``'s record of every consumer."""
        return f"{glob_escape(self.prefix)}:{{*:{glob_escape(escape_key_part(message_id))}}}"
