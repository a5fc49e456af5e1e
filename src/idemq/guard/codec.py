"""How a payload is hashed and a result stored for replay (public ``json`` module only).

A duplicate is answered with the result the first delivery stored, so what a handler returns must
survive a trip through the store exactly: ``None``, ``0``, ``False`` and ``""`` stay what they
were, and with a typed codec a dataclass or pydantic model comes back as the same type. A payload
is hashed so that the same message id reused for another message is caught
(:class:`~idemq.PayloadMismatchError`) rather than answered with the first message's result.

**The canonical payload rule** (:func:`hash_payload`). ``bytes`` are hashed as they are and a
``str`` as its UTF-8; anything else is turned into canonical JSON first, so that two payloads that
mean the same hash the same:

* dict keys are sorted (so key order never matters; keys of mixed types cannot be sorted and
  are refused);
* tuples, lists and sets become lists — a set's (or frozenset's) elements sorted by their own
  canonical text, so set order never matters;
* ``Decimal`` becomes its normalized decimal text (``Decimal("1.50")`` and ``Decimal("1.5")``
  are the same amount; NaN and infinities are refused); a ``float`` stays a JSON number;
* aware ``datetime`` becomes ISO 8601 in UTC (the same instant in two time zones is the same);
  naive ``datetime``, ``date`` and ``time`` their ISO 8601 text;
* an ``Enum`` member its value, a ``UUID`` its text, bytes inside a structure their hex;
* a dataclass its fields (``dataclasses.asdict``), a pydantic model ``model_dump(mode="json")``.

Anything else is refused with :class:`~idemq.InvalidMessageError`, never hashed by its ``repr``.
A payload of JSON values alone hashes exactly as it always has, so a message delivered before an
upgrade and again after it is still recognised.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import hashlib
import json
import uuid
from datetime import UTC, date, datetime, time
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from idemq.errors import ConfigurationError, InvalidMessageError, ResultNotSerializableError
from idemq.stores.base import STORED_NONE

__all__ = [
    "NULL_RESULT",
    "Codec",
    "DataclassCodec",
    "JsonCodec",
    "PydanticCodec",
    "decode_result",
    "encode_result",
    "hash_payload",
]

T = TypeVar("T")

NULL_RESULT = STORED_NONE
"""A ``None`` result as stored, whatever the codec: the result a transactional claim row is
written with (the stores' :data:`~idemq.stores.base.STORED_NONE`, one value for both floors)."""

# Built once: json.dumps with any non-default option builds a new JSONEncoder per call.
_RESULT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# For a result holding a lone surrogate ("\udcff"): no database driver can encode that text as
# UTF-8, but JSON's own escape (\udcff) stores it and decodes back to the very same string.
_RESULT_JSON_ASCII = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _canonical(value: Any) -> Any:
    """``value``'s non-JSON parts replaced as the module doc's rule says (see ``default``)."""
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a number a payload can hold")
        return format(value.normalize(), "f")
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat() if value.tzinfo else value.isoformat()
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, set | frozenset):
        return sorted(_canonical_text(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):  # a pydantic v2 model
        return model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} has no canonical form")


def _canonical_text(value: Any) -> str:
    return _PAYLOAD_JSON.encode(value)


_PAYLOAD_JSON = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_canonical
)


def hash_payload(payload: object) -> str | None:
    """SHA-256 hex of a payload by the canonical rule of this module's docstring."""
    if payload is None:
        return None
    if isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    elif isinstance(payload, str):
        data = payload.encode("utf-8", "surrogatepass")
    else:
        try:
            data = _canonical_text(payload).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError) as exc:
            raise InvalidMessageError(
                f"payload of type {type(payload).__name__} has no canonical JSON form: {exc}"
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
        text = _RESULT_JSON.encode(result)
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                text = _RESULT_JSON_ASCII.encode(result)
        return text
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultNotSerializableError(
            f"handler result of type {type(result).__name__} cannot be stored as JSON: {exc}"
        ) from exc


def decode_result(text: str | bytes | None) -> Any:
    """Inverse of :func:`encode_result` (JSON: tuples come back as lists, dict keys as str)."""
    if text is None or text == NULL_RESULT:
        return None
    return json.loads(text)


@runtime_checkable
class Codec(Protocol[T]):
    """How a guard stores a handler's result and replays it to duplicates.

    ``encode`` is never given ``None`` and ``decode`` never given the stored form of ``None``
    (:data:`NULL_RESULT`): the guard handles ``None`` itself, the same for every codec.
    ``encode`` raises :class:`~idemq.ResultNotSerializableError` for what it cannot store.
    """

    def encode(self, result: T) -> str:
        """The text to store for ``result``."""
        ...

    def decode(self, text: str) -> T:
        """The result a duplicate is answered with."""
        ...


class JsonCodec:
    """The default: JSON values (dict, list, str, int, float, bool), replayed as JSON gives
    them back (tuples as lists, dict keys as str)."""

    def encode(self, result: Any) -> str:
        """See :func:`encode_result`."""
        return encode_result(result)

    def decode(self, text: str) -> Any:
        """See :func:`decode_result`."""
        return decode_result(text)


class DataclassCodec(Generic[T]):
    """Results that are instances of one dataclass, replayed as instances of it.

    The fields must be JSON values (nested dataclasses come back as dicts: give such a result
    a codec of your own, or use pydantic).
    """

    def __init__(self, cls: type[T]) -> None:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ConfigurationError(f"DataclassCodec needs a dataclass, got {cls!r}")
        self.cls = cls

    def encode(self, result: T) -> str:
        """The dataclass's fields as a JSON object."""
        if not isinstance(result, self.cls):
            raise ResultNotSerializableError(
                f"result is a {type(result).__name__}, this guard stores {self.cls.__name__}"
            )
        return encode_result(dataclasses.asdict(result))  # type: ignore[call-overload]

    def decode(self, text: str) -> T:
        """An instance built from the stored fields."""
        return self.cls(**decode_result(text))


class PydanticCodec(Generic[T]):
    """Results that are instances of one pydantic (v2) model, replayed as instances of it."""

    def __init__(self, model: type[T]) -> None:
        if not callable(getattr(model, "model_validate_json", None)):
            raise ConfigurationError(f"PydanticCodec needs a pydantic v2 model, got {model!r}")
        self.model = model

    def encode(self, result: T) -> str:
        """The model's JSON (``model_dump_json``)."""
        if not isinstance(result, self.model):
            raise ResultNotSerializableError(
                f"result is a {type(result).__name__}, this guard stores {self.model.__name__}"
            )
        text: str = result.model_dump_json()  # type: ignore[attr-defined]
        return text

    def decode(self, text: str) -> T:
        """The model validated from the stored JSON."""
        value: T = self.model.model_validate_json(text)  # type: ignore[attr-defined]
        return value
