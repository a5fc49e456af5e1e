"""idemq's dedup table, outbox tables and schema-version record (see ``_schema``)."""

from django.db import migrations

from idemq.integrations.django._schema import create_tables, drop_tables


class Migration(migrations.Migration):
    """Creates ``message_idempotent``, ``idemq_outbox``, ``idemq_outbox_dead`` and
    ``idemq_schema_version`` as idemq's own ``create_schema`` makes them; reversible."""

    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012 -- Django reads the class attributes
    operations = [migrations.RunPython(create_tables, drop_tables, elidable=False)]  # noqa: RUF012
