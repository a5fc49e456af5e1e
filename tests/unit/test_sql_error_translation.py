"""What the one SQL error boundary (``translate_db_error``) makes of errors whose text the
drivers or SQLAlchemy compose themselves: a password in it never reaches the idemq error."""

from __future__ import annotations

import pytest
from sqlalchemy import exc

from idemq.drivers.sql import translate_db_error
from idemq.errors import StoreError, StoreUnavailableError

SECRET = "hunter2-sqlhouse"


class _DriverError(Exception):
    """Stands for a DB-API driver's exception class (its text is what matters here)."""


@pytest.mark.parametrize(
    "text",
    [
        f"invalid dsn: invalid connection option in host=db user=app password={SECRET} x=1",
        f"connection to postgresql://app:{SECRET}@db.internal:5432/orders failed",
        f"bad URL mysql+pymysql://app:{SECRET}@db:3306/x, password = '{SECRET}'",
    ],
)
def test_a_password_in_a_driver_message_is_masked(text: str) -> None:
    wrapped = exc.DBAPIError.instance("SELECT 1", {}, _DriverError(text), _DriverError)
    translated = translate_db_error(wrapped, "connect")
    assert isinstance(translated, StoreError)
    assert SECRET not in str(translated)
    assert str(translated).startswith("connect failed: _DriverError:")


def test_a_password_in_sqlalchemys_own_message_is_masked() -> None:
    own = exc.DisconnectionError(f"lost postgresql+psycopg://app:{SECRET}@db/orders")
    translated = translate_db_error(own, "claim")
    assert isinstance(translated, StoreUnavailableError)
    assert SECRET not in str(translated)
    assert "postgresql+psycopg://app:***@db/orders" in str(translated)
