"""The synthesis config: validation errors name the field; keys never reach the manifest."""

from __future__ import annotations

import pytest

from workers.synthesis.spec import SpecError, parse_config


def test_defaults_and_round_robin_inputs_validate() -> None:
    cfg = parse_config({"generators": [{"kind": "math", "count": 3, "difficulties": [3, 1, 3]}]})
    assert cfg.generators[0].difficulties == [1, 3]
    assert cfg.workers == 2 and cfg.dedup.threshold == 0.8


@pytest.mark.parametrize(("data", "field"), [
    ({"generators": []}, "generators"),
    ({"generators": [{"kind": "math", "count": 0}]}, "0 items"),
    ({"generators": [{"kind": "math", "topics": ["poetry"]}]}, "generators.0.math.topics.0"),
    ({"generators": [{"kind": "math", "difficulties": [6]}]}, "difficulties"),
    ({"generators": [{"kind": "math"}], "colour": 1}, "colour"),
    ({"generators": [{"kind": "model", "endpoint": {"base_url": "ftp://x", "model": "m"}}]},
     "base_url"),
    ({"generators": [{"kind": "math"}], "parents": ["abc"]}, "parents.0"),
])
def test_bad_configs_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_config(data)
    assert field in str(err.value)


def test_api_keys_are_redacted_in_the_public_config() -> None:
    cfg = parse_config({"generators": [{"kind": "model", "endpoint": {
        "base_url": "http://127.0.0.1:1/v1", "model": "m", "api_key": "sekret"}}]})
    assert "sekret" not in cfg.to_json()
    assert cfg.public_dict()["generators"][0]["endpoint"]["api_key"] == "***"
