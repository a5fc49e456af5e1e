"""Every idemq exception pickles and unpickles to the same class with the same message.

Celery hands a task's exception to its caller pickled, and a process pool hands a worker's back
the same way: a caller must be able to ``except PayloadMismatchError``, not just IdemqError.
"""

from __future__ import annotations

import inspect
import pickle

import pytest

import idemq.errors

SPECIAL_ARGUMENTS: dict[type[Exception], tuple[object, ...]] = {
    idemq.errors.PayloadMismatchError: ("ORDER_1", "a" * 64, "b" * 64),
    idemq.errors.ClockMovedBackwardsError: (1_700_000_001_000, 1_700_000_000_000),
}
ERRORS = [
    cls
    for _, cls in inspect.getmembers(idemq.errors, inspect.isclass)
    if issubclass(cls, idemq.errors.IdemqError) and cls.__module__ == "idemq.errors"
]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_idemq_error_survives_pickling(cls: type[Exception]):
    error = cls(*SPECIAL_ARGUMENTS.get(cls, ("something went wrong",)))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls
    assert str(again) == str(error)
    assert vars(again) == vars(error)  # its attributes too (message_id, hashes …)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_idemq_error_is_rebuilt_from_its_type_and_args(cls: type[Exception]):
    # How Celery's result backends carry a task's exception back to its caller.
    error = cls(*SPECIAL_ARGUMENTS.get(cls, ("something went wrong",)))
    again = cls(*error.args)
    assert str(again) == str(error)


def test_every_error_is_checked():
    assert len(ERRORS) >= 16
    assert set(SPECIAL_ARGUMENTS) <= set(ERRORS)
