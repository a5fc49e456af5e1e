"""The project's ASGI application (served by uvicorn in the tests)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.integration.django.djproject.settings")
application = get_asgi_application()
