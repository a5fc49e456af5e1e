"""The id text format: ``PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ`` validated, formatted and parsed."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from idemq.errors import ConfigurationError, InvalidMessageIdError

MAX_MESSAGE_ID_LENGTH = 128


#: 9999-12-31T23:59:59.999Z. Beyond it the year needs 5 digits and string order stops being
#: time order, so the generator refuses such clock readings.
MAX_TIMESTAMP_MS = 253_402_300_799_999


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


_PART_RE = re.compile(r"[A-Za-z0-9-]+", re.ASCII)


_ID_RE = re.compile(
    r"(?P<prefix>[A-Za-z0-9-]+)_(?P<ts>[0-9]{17}|[0-9]{14})_(?P<node>[A-Za-z0-9-]+)_(?P<seq>[0-9]{1,9})",
    re.ASCII,
)


def validate_id_part(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid prefix/node (ASCII letters, digits, ``-``), else raise.

    ``_`` is refused because it separates the fields: ``A_B`` as a prefix would make ids
    ambiguous to parse. Raises :class:`~idemq.ConfigurationError`.
    """
    if not isinstance(value, str) or not _PART_RE.fullmatch(value):
        raise ConfigurationError(
            f"message id {kind} must be a non-empty string of ASCII letters, digits and '-' "
            f"(no '_', it separates the fields); got {value!r}"
        )
    return value


def _second_text(epoch_s: int) -> str:
    t = time.gmtime(epoch_s)
    return (
        f"{t.tm_year:04d}{t.tm_mon:02d}{t.tm_mday:02d}{t.tm_hour:02d}{t.tm_min:02d}{t.tm_sec:02d}"
    )


def format_timestamp_ms(epoch_ms: int) -> str:
    """Format epoch milliseconds as the 17-digit UTC ``yyyyMMddHHmmssSSS`` field of an id."""
    if not 0 <= epoch_ms <= MAX_TIMESTAMP_MS:
        raise ConfigurationError(f"timestamp {epoch_ms} ms is outside 1970..9999")
    seconds, millis = divmod(epoch_ms, 1000)
    return f"{_second_text(seconds)}{millis:03d}"


@dataclass(frozen=True, slots=True)
class MessageIdParts:
    """The fields of a parsed id. ``timestamp`` is an aware UTC datetime; for the seed's
    14-digit (second precision) form its microseconds are 0."""

    prefix: str
    timestamp: datetime
    node: str
    sequence: int

    @property
    def timestamp_ms(self) -> int:
        """The timestamp as integer epoch milliseconds."""
        return (self.timestamp - _EPOCH) // timedelta(milliseconds=1)

    def to_dict(self) -> dict[str, str | int]:
        """JSON-friendly form (ISO-8601 timestamp), e.g. for ``idemq id parse``."""
        return {
            "prefix": self.prefix,
            "timestamp": self.timestamp.isoformat(timespec="milliseconds"),
            "timestamp_ms": self.timestamp_ms,
            "node": self.node,
            "sequence": self.sequence,
        }


def parse_message_id(message_id: object) -> MessageIdParts:
    """Split ``PREFIX_yyyyMMddHHmmssSSS_NODE_SEQ`` (or the 14-digit ``…HHmmss…`` seed form).

    Raises :class:`~idemq.InvalidMessageIdError` for anything else, including impossible dates.
    """
    if not isinstance(message_id, str):
        raise InvalidMessageIdError(f"message id must be a str, got {type(message_id).__name__}")
    if len(message_id) > MAX_MESSAGE_ID_LENGTH:
        raise InvalidMessageIdError(f"message id is longer than {MAX_MESSAGE_ID_LENGTH} chars")
    match = _ID_RE.fullmatch(message_id)
    if match is None:
        raise InvalidMessageIdError(
            f"{message_id!r} is not PREFIX_yyyyMMddHHmmss[SSS]_NODE_SEQ "
            "(PREFIX/NODE: letters, digits, '-'; SEQ: 1-9 digits)"
        )
    ts = match["ts"]
    try:
        timestamp = datetime(
            int(ts[0:4]),
            int(ts[4:6]),
            int(ts[6:8]),
            int(ts[8:10]),
            int(ts[10:12]),
            int(ts[12:14]),
            int(ts[14:17] or 0) * 1000,
            tzinfo=UTC,
        )
    except ValueError as exc:
        raise InvalidMessageIdError(f"{message_id!r} has an impossible timestamp {ts}") from exc
    return MessageIdParts(match["prefix"], timestamp, match["node"], int(match["seq"]))
