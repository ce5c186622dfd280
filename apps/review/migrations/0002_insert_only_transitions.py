"""Transition rows are history: the database refuses to UPDATE what they say, whatever
code path (admin, shell, a bug) tries. Only the actor column may change (SET NULL when a
user is deleted); deleting still cascades with their batch or team."""

from django.db import migrations

TABLES = {
    "review_batchtransition": "batch_id, from_status, to_status, reason, data, actor_label, "
                              "created_at",
    "review_reviewtransition": "item_id, from_status, to_status, reason, actor_label, "
                               "created_at",
}
MESSAGE = "review transitions are insert-only"


def _sqlite_up(table: str) -> str:
    return (f"CREATE TRIGGER {table}_insert_only BEFORE UPDATE OF {TABLES[table]} ON {table} "
            f"BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END;")


def _postgres_up(table: str) -> str:
    return (f"CREATE TRIGGER {table}_insert_only BEFORE UPDATE OF {TABLES[table]} ON {table} "
            "FOR EACH ROW "
            "EXECUTE FUNCTION crucible_review_insert_only();")


POSTGRES_FUNCTION = f"""
CREATE OR REPLACE FUNCTION crucible_review_insert_only() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION '{MESSAGE}';
END; $$ LANGUAGE plpgsql;
"""


def up(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRES_FUNCTION)
    for table in TABLES:
        if vendor == "sqlite":
            schema_editor.execute(_sqlite_up(table))
        elif vendor == "postgresql":
            schema_editor.execute(_postgres_up(table))


def down(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    for table in TABLES:
        if vendor == "sqlite":
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_insert_only;")
        elif vendor == "postgresql":
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_insert_only ON {table};")
    if vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION IF EXISTS crucible_review_insert_only();")


class Migration(migrations.Migration):
    dependencies = [("review", "0001_initial")]

    operations = [migrations.RunPython(up, down)]
