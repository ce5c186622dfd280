"""The run config: defaults validate, unknown or bad fields are errors that name the field."""

import subprocess
import sys

import pytest

from workers.rl.spec import RunSpec, SpecError, load_spec, parse_spec


def test_defaults_round_trip_through_json():
    spec = RunSpec()
    assert parse_spec(RunSpec.model_validate_json(spec.to_json()).model_dump()) == spec


def test_unknown_field_is_named():
    with pytest.raises(SpecError, match=r"trainer\.stepz: Extra inputs are not permitted"):
        parse_spec({"trainer": {"stepz": 3}})
    with pytest.raises(SpecError, match=r"colour"):
        parse_spec({"colour": "red"})


def test_bad_values_are_named():
    with pytest.raises(SpecError) as err:
        parse_spec({"trainer": {"zero_stage": 5, "lr": -1}, "rollout": {"top_p": 1.5}})
    msg = str(err.value)
    for field in ("trainer.zero_stage", "trainer.lr", "rollout.top_p"):
        assert field in msg
    with pytest.raises(SpecError, match="model.path is required"):
        parse_spec({"model": {"source": "path"}})
    with pytest.raises(SpecError, match="ratio_mask_low must be < ratio_mask_high"):
        parse_spec({"algorithm": {"ratio_mask_low": 2.0, "ratio_mask_high": 1.0}})
    with pytest.raises(SpecError, match=r"curriculum: Value error, band_low must be <="):
        parse_spec({"curriculum": {"band_low": 0.8, "band_high": 0.2}})
    with pytest.raises(SpecError) as err:
        parse_spec({"trainer": {"max_async_steps": -1, "sync_timeout_s": 0},
                    "curriculum": {"explore": 2.0}})
    for field in ("trainer.max_async_steps", "trainer.sync_timeout_s", "curriculum.explore"):
        assert field in str(err.value)


def test_spec_module_imports_nothing_heavy():
    code = (
        "import sys, workers.rl.spec;"
        "bad = [m for m in ('torch', 'transformers', 'deepspeed', 'django') if m in sys.modules];"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_toml_file_and_cli_validate(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('name = "x"\n[trainer]\nsteps = 3\nzero_stage = 3\n')
    assert load_spec(good).trainer.zero_stage == 3
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ngroup_sise = 4\n")
    out = subprocess.run([sys.executable, "-m", "workers.rl", "validate", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "rollout.group_sise" in out.stderr
