"""The Django app: ``"idemq.integrations.django"`` in ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["IdemqConfig"]


class IdemqConfig(AppConfig):
    """idemq's tables (migrations) and ``python manage.py idemq``."""

    name = "idemq.integrations.django"
    label = "idemq"
    verbose_name = "idemq"
