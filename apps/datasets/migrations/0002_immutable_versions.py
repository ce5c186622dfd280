"""Make dataset versions immutable in the database itself: any UPDATE of a version's
content columns aborts, whatever code path (admin, shell, a bug) attempts it."""

from django.db import migrations

COLUMNS = "digest, uri, record_count, size_bytes, schema, number, dataset_id, team_id"

SQLITE_UP = f"""
CREATE TRIGGER datasetversion_immutable BEFORE UPDATE OF {COLUMNS}
ON datasets_datasetversion
BEGIN SELECT RAISE(ABORT, 'dataset versions are immutable; upload a new version'); END;
"""
SQLITE_DOWN = "DROP TRIGGER IF EXISTS datasetversion_immutable;"

POSTGRES_UP = f"""
CREATE OR REPLACE FUNCTION crucible_datasetversion_immutable() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'dataset versions are immutable; upload a new version';
END; $$ LANGUAGE plpgsql;
CREATE TRIGGER datasetversion_immutable BEFORE UPDATE OF {COLUMNS}
ON datasets_datasetversion FOR EACH ROW EXECUTE FUNCTION crucible_datasetversion_immutable();
"""
POSTGRES_DOWN = """
DROP TRIGGER IF EXISTS datasetversion_immutable ON datasets_datasetversion;
DROP FUNCTION IF EXISTS crucible_datasetversion_immutable();
"""


def _run(sql_by_vendor):
    def apply(apps, schema_editor):
        sql = sql_by_vendor.get(schema_editor.connection.vendor)
        if sql:
            schema_editor.execute(sql)

    return apply


class Migration(migrations.Migration):
    dependencies = [("datasets", "0001_initial")]

    operations = [
        migrations.RunPython(
            _run({"sqlite": SQLITE_UP, "postgresql": POSTGRES_UP}),
            _run({"sqlite": SQLITE_DOWN, "postgresql": POSTGRES_DOWN}),
        )
    ]
