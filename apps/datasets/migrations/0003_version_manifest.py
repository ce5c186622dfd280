"""Versions carry the manifest of the batch they came from. The immutability trigger is
recreated to cover it (and because SQLite drops a table's triggers when a migration
rebuilds the table)."""

from django.db import migrations, models

COLUMNS = "digest, uri, record_count, size_bytes, schema, number, dataset_id, team_id, manifest"
OLD_COLUMNS = "digest, uri, record_count, size_bytes, schema, number, dataset_id, team_id"
MESSAGE = "dataset versions are immutable; upload a new version"


def _sqlite(columns: str) -> list[str]:
    return [
        "DROP TRIGGER IF EXISTS datasetversion_immutable;",
        f"""CREATE TRIGGER datasetversion_immutable BEFORE UPDATE OF {columns}
        ON datasets_datasetversion
        BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END;""",
    ]


def _postgres(columns: str) -> list[str]:
    # The function from 0002 stays; only the trigger's column list changes.
    return [
        "DROP TRIGGER IF EXISTS datasetversion_immutable ON datasets_datasetversion;",
        f"""CREATE TRIGGER datasetversion_immutable BEFORE UPDATE OF {columns}
        ON datasets_datasetversion FOR EACH ROW
        EXECUTE FUNCTION crucible_datasetversion_immutable();""",
    ]


def _trigger(columns: str):
    def apply(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        statements = {"sqlite": _sqlite, "postgresql": _postgres}.get(vendor)
        for sql in statements(columns) if statements else []:
            schema_editor.execute(sql)

    return apply


class Migration(migrations.Migration):
    dependencies = [("datasets", "0002_immutable_versions")]

    operations = [
        migrations.AddField(
            model_name="datasetversion",
            name="manifest",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(_trigger(COLUMNS), _trigger(OLD_COLUMNS)),
    ]
