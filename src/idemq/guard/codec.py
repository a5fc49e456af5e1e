"""How a payload is hashed and a result stored for replay: one JSON codec, public ``json`` only.

A duplicate is answered with the result the first delivery stored, so what a handler returns
must survive a trip through the store exactly: ``None``, ``0``, ``False`` and ``""`` stay what
they were. A payload is hashed so that the same message id reused for another message is caught
(:class:`~idemq.PayloadMismatchError`) rather than answered with the first message's result.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from idemq.errors import InvalidMessageError, ResultNotSerializableError

__all__ = ["NULL_RESULT", "decode_result", "encode_result", "hash_payload"]

NULL_RESULT = "null"
"""``encode_result(None)``: the result a transactional claim row is written with, so a handler
that returns ``None`` needs no second statement."""

# Built once: json.dumps with any non-default option builds a new JSONEncoder per call.
_PAYLOAD_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_RESULT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def hash_payload(payload: object) -> str | None:
    """SHA-256 hex of a payload: bytes as is, str as UTF-8, anything else as canonical JSON."""
    if payload is None:
        return None
    if isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    elif isinstance(payload, str):
        data = payload.encode("utf-8", "surrogatepass")
    else:
        try:
            data = _PAYLOAD_JSON.encode(payload).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise InvalidMessageError(
                f"payload of type {type(payload).__name__} is not bytes, str or JSON-serializable"
            ) from exc
    return hashlib.sha256(data).hexdigest()


def encode_result(result: object) -> str:
    """The JSON text stored for replay. ``None``/``0``/``False``/``""`` all round-trip exactly.

    A result JSON cannot hold (a set, NaN, an object that contains itself) raises
    :class:`~idemq.ResultNotSerializableError` before anything is stored.
    """
    if result is None:
        return NULL_RESULT
    try:
        return _RESULT_JSON.encode(result)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON: {exc}"
        ) from exc


def decode_result(text: str | bytes | None) -> Any:
    """Inverse of :func:`encode_result` (JSON: tuples come back as lists, dict keys as str)."""
    if text is None or text == NULL_RESULT:
        return None
    return json.loads(text)
