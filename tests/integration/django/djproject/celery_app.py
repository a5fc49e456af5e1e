"""``celery -A tests.integration.django.djproject.celery_app worker``: Django first, then tasks."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.integration.django.djproject.settings")
django.setup()

from tests.integration.django.shop.tasks import app  # noqa: E402

__all__ = ["app"]
