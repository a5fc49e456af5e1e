"""mask_url: the one masker of every URL idemq logs or puts in an error message; is_redis_url."""

from __future__ import annotations

import pytest

from idemq.brokers import base as brokers_base
from idemq.drivers.urls import is_redis_url, mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("amqp://guest:secret@127.0.0.1:5672/", "amqp://guest:***@127.0.0.1:5672/"),
        ("postgresql+psycopg://u:p@db/test", "postgresql+psycopg://u:***@db/test"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("embedded:///tmp/q.db", "embedded:///tmp/q.db"),
        ("embedded:///tmp/a@b.db", "embedded:///tmp/a@b.db"),
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("nats://hunter2@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        ("redis://u:hun@ter2@h:1/0?x=1", "redis://u:***@h:1/0?x=1"),
        ("redis://u:hun:ter2@h/0", "redis://u:***@h/0"),
        ("rediss://u:hunter2@[::1]:6380/0", "rediss://u:***@[::1]:6380/0"),
        ("redis://u:hunter2@h:not-a-port/0", "redis://u:***@h:not-a-port/0"),
        ("u:hunter2@h/0", "u:***@h/0"),
        # A lone user name is no secret: shown, as beside a password (one rule everywhere).
        ("amqp://guest@127.0.0.1:5672/", "amqp://guest@127.0.0.1:5672/"),
        (
            "postgresql+psycopg://postgres@127.0.0.1/test",
            "postgresql+psycopg://postgres@127.0.0.1/test",
        ),
        ("redis://alice@h:6379/0", "redis://alice@h:6379/0"),
        # ... except NATS's lone userinfo, which nats-py reads as the auth token.
        ("tls://hunter2@127.0.0.1:4222", "tls://***@127.0.0.1:4222"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize("url", ["redis://u:hunter2@[::1/0", "http://[hunter2", ""])
def test_malformed_urls_never_raise_nor_leak(url: str) -> None:
    assert "hunter2" not in mask_url(url)


def test_the_brokers_mask_is_the_same_function() -> None:
    assert brokers_base.mask_url is mask_url


@pytest.mark.parametrize(
    ("with_password", "without_password"),
    [
        ("amqp://guest:pw@h/", "amqp://guest@h/"),
        ("postgresql+psycopg://postgres:pw@h/test", "postgresql+psycopg://postgres@h/test"),
        ("mysql+pymysql://root:pw@h/test", "mysql+pymysql://root@h/test"),
        ("redis://alice:pw@h/0", "redis://alice@h/0"),
    ],
)
def test_the_user_is_shown_whether_or_not_a_password_follows(
    with_password: str, without_password: str
) -> None:
    user = without_password.split("//")[1].split("@", maxsplit=1)[0]
    assert f"//{user}:***@" in mask_url(with_password)
    assert f"//{user}@" in mask_url(without_password)


@pytest.mark.parametrize(
    ("url", "redis"),
    [
        ("redis://localhost:6379/0", True),
        ("REDISS://:pw@host/1", True),
        ("unix:///run/redis.sock", True),
        ("postgresql+psycopg://u@h/db", False),
        ("sqlite:///redis.db", False),
        ("redis", False),
    ],
)
def test_a_redis_url_is_told_apart_from_an_sqlalchemy_url(url: str, redis: bool) -> None:
    assert is_redis_url(url) is redis
