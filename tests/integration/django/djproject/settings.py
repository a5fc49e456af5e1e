"""A real Django project for idemq's tests: the databases come from the environment.

``IDEMQ_DJ_DATABASES``: Django's ``DATABASES`` as JSON (the tests make fresh databases on
PostgreSQL and MariaDB and a SQLite file, and pass them here, in-process and to subprocesses).
"""

from __future__ import annotations

import json
import os

import pymysql

# Django's MySQL backend speaks the MySQLdb API; PyMySQL provides it.
pymysql.install_as_MySQLdb()

SECRET_KEY = "idemq-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.integration.django.djproject.urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "idemq.integrations.django",
    "tests.integration.django.shop",
]
MIDDLEWARE = ["idemq.integrations.django.IdempotencyKeyMiddleware"]
DATABASES = json.loads(os.environ["IDEMQ_DJ_DATABASES"])
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
IDEMQ_HTTP = json.loads(os.environ.get("IDEMQ_DJ_HTTP", "{}"))
CELERY_BROKER_URL = os.environ.get("IDEMQ_DJ_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
LOGGING_CONFIG = None
# The tests of the migrations' table names set these; unset, idemq's defaults are made.
if "IDEMQ_DJ_TABLE" in os.environ:
    IDEMQ_TABLE = os.environ["IDEMQ_DJ_TABLE"]
if "IDEMQ_DJ_OUTBOX_TABLE" in os.environ:
    IDEMQ_OUTBOX_TABLE = os.environ["IDEMQ_DJ_OUTBOX_TABLE"]
