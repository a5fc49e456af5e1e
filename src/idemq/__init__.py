"""idemq: exactly-once business effects for at-least-once message consumers."""

from idemq.errors import (
    ClockMovedBackwardsError,
    ConfigurationError,
    IdemqError,
    InvalidBusinessIdError,
    InvalidInputError,
    InvalidMessageError,
    InvalidMessageIdError,
    LeaseLostError,
    LockError,
    LockNotOwnedError,
    PayloadMismatchError,
    ResultNotSerializableError,
    StoreError,
    StoreUnavailableError,
)

__version__ = "0.1.0"
