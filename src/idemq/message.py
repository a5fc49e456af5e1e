"""The message a consumer hands to a handler, whatever the broker."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from idemq.errors import InvalidMessageError

__all__ = ["BUSINESS_ID_HEADER", "MESSAGE_ID_HEADER", "Message"]

MESSAGE_ID_HEADER = "idemq-message-id"
BUSINESS_ID_HEADER = "idemq-business-id"


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery of a message.

    ``id`` is the dedup key (the broker's message id or the ``idemq-message-id`` header);
    ``delivery_attempt`` is idemq's attempt number: 1, plus one for every earlier delivery whose
    handler ran and failed (redeliveries after a store outage, a crash or a lease held by a twin
    do not count).
    """

    id: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    business_id: str | None = None
    delivery_attempt: int = 1

    def json(self) -> Any:
        """Decode the body as UTF-8 JSON; raise :class:`~idemq.InvalidMessageError` if it is not."""
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidMessageError(f"message {self.id!r}: body is not JSON ({exc})") from exc
