"""The one reader of CRUCIBLE_VAR_DIR (workers/paths.py), which the web settings, the Celery
app and the workers share."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import env
from workers.paths import DEFAULT_VAR_DIR, var_dir
from workers.storage import default_store


def test_the_setting_is_made_absolute_and_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", " state ")
    assert var_dir() == tmp_path / "state" and (tmp_path / "state").is_dir()


def test_blank_means_the_folder_beside_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", "  ")
    assert var_dir() == DEFAULT_VAR_DIR == Path(env.BASE_DIR) / "var"


def test_config_and_the_object_store_default_read_the_same_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "v"))
    monkeypatch.delenv("OBJECT_STORE_URL", raising=False)
    assert env.var_dir() == tmp_path / "v"
    assert env.object_store_url() == default_store().url == (tmp_path / "v" / "objects").as_uri()
