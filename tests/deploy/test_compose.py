"""deploy/compose.yaml against the Compose Specification's JSON schema (the copy that
check-jsonschema vendors, Apache-2.0, validated offline), then what a schema cannot see:
every variable it uses is in .env.example and every one there is used, dependencies exist and
wait for the right thing, one worker per Celery queue, workers hold no database credentials,
every variable handed to a Crucible process is one Crucible reads."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest

from tests.deploy.files import (
    COMPOSE,
    DOCKER,
    celery_queues,
    compose_variables,
    env_example,
    interpolate,
    load_compose,
    parse_dockerfile,
    repo_env_names,
)

# Variables third-party code reads inside Crucible's containers.
THIRD_PARTY = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_ADDRESS"}
CONTROL_PLANE_ONLY = {"DATABASE_URL", "SECRET_KEY"}


def compose_schema() -> dict:
    vendor = resources.files("check_jsonschema") / "builtin_schemas" / "vendor"
    return json.loads((vendor / "compose-spec.json").read_text())


def validate(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)]


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(env_example())


def crucible_services(compose: dict) -> dict[str, dict]:
    prefix = env_example()["CRUCIBLE_IMAGE_PREFIX"] + "-"
    return {name: svc for name, svc in compose["services"].items()
            if svc.get("image", "").startswith(prefix)}


def test_schema_is_the_compose_specification() -> None:
    schema = compose_schema()
    assert schema.get("$id") == "compose_spec.json"
    assert {"services", "volumes", "networks"} <= set(schema["properties"])


def test_compose_file_validates_against_the_schema_raw_and_interpolated() -> None:
    assert validate(load_compose()) == []
    assert validate(load_compose(env_example())) == []


def test_schema_check_catches_a_broken_file(compose: dict) -> None:
    broken = json.loads(json.dumps(compose))
    broken["services"]["web"]["depends_on"]["migrate"]["condition"] = "service_done"
    broken["services"]["web"]["restart_policy"] = "always"
    errors = validate(broken)
    assert any("depends_on" in e for e in errors)
    assert any("restart_policy" in e for e in errors)


def test_every_variable_is_in_env_example_and_every_example_is_used() -> None:
    used = compose_variables(COMPOSE.read_text())
    listed = set(env_example())
    assert used - listed == set(), f"compose.yaml uses variables not listed: {used - listed}"
    assert listed - used == set(), f".env.example lists variables nothing uses: {listed - used}"


def test_env_example_holds_no_secrets() -> None:
    values = env_example()
    for key in ("SECRET_KEY", "POSTGRES_PASSWORD", "CRUCIBLE_WORKER_TOKEN",
                "CRUCIBLE_METRICS_TOKEN"):
        assert values[key] == "", f"{key} must be left empty in .env.example"
    assert "development-only" in values["AWS_SECRET_ACCESS_KEY"]


def test_required_secrets_fail_loudly_when_unset() -> None:
    for secret in ("POSTGRES_PASSWORD", "SECRET_KEY"):
        text = interpolate(COMPOSE.read_text(), {**env_example(), secret: ""})
        assert f"<{secret} unset>" in text, f"compose starts with an empty {secret}"


def test_depends_on_targets_exist_with_sound_conditions(compose: dict) -> None:
    services = compose["services"]
    dockerfile_health = {}
    for path in (DOCKER / "Dockerfile", DOCKER / "gpu.Dockerfile"):
        parsed = parse_dockerfile(path)
        for stage in parsed.stages:
            if stage.name:
                dockerfile_health[stage.name] = parsed.effective(stage, "HEALTHCHECK")
    image_target = {svc["image"]: svc["build"].get("target", "worker-gpu")
                    for svc in services.values() if "build" in svc}

    def has_healthcheck(name: str) -> bool:
        svc = services[name]
        if "healthcheck" in svc:
            return not svc["healthcheck"].get("disable", False)
        target = image_target.get(svc["image"])
        return bool(target and dockerfile_health.get(target))

    for name, svc in services.items():
        for dep, how in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on {dep}, which is not a service"
            condition = how["condition"]
            if condition == "service_healthy":
                assert has_healthcheck(dep), f"{name} waits for {dep}'s health; it has no check"
            if condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is not a one-shot service"


def test_migrations_are_a_one_shot_everything_with_the_database_waits_for(compose: dict) -> None:
    services = compose["services"]
    migrate = services["migrate"]
    assert migrate["command"][-3:] == ["manage.py", "migrate", "--noinput"]
    assert migrate["restart"] == "no"
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if "DATABASE_URL" in env and name != "migrate":
            assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully", (
                f"{name} uses the database but does not wait for the migrations")


def test_one_worker_service_per_queue(compose: dict) -> None:
    by_queue = {}
    for name, svc in compose["services"].items():
        queues = (svc.get("environment") or {}).get("CRUCIBLE_WORKER_QUEUES")
        if queues:
            by_queue[queues] = name
    assert set(by_queue) == set(celery_queues())
    gpu = compose["services"][by_queue["gpu"]]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    sandbox = compose["services"][by_queue["sandbox"]]
    assert sandbox.get("privileged") is True
    cpu = compose["services"][by_queue["cpu"]]
    assert not cpu.get("privileged")


def test_workers_hold_no_database_credentials(compose: dict) -> None:
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        if "CRUCIBLE_WORKER_TOKEN" in env:
            leaked = CONTROL_PLANE_ONLY & set(env)
            assert not leaked, f"{name} is a pool but gets {leaked}"
            assert env["CRUCIBLE_API_URL"].startswith("http://web:")


def test_every_variable_a_crucible_service_gets_is_one_crucible_reads(compose: dict) -> None:
    known = repo_env_names() | THIRD_PARTY
    for name, svc in crucible_services(compose).items():
        unknown = set(svc.get("environment") or {}) - known
        assert not unknown, f"{name} sets variables nothing reads: {unknown}"


def test_services_the_design_names_are_there(compose: dict) -> None:
    services = compose["services"]
    for name in ("postgres", "redis", "s3", "migrate", "web", "beat", "agent", "ray-head"):
        assert name in services
    assert services["agent"]["command"] == ["python", "-m", "workers.agent"]
    assert services["ray-head"]["command"][:3] == ["ray", "start", "--head"]
    assert services["web"]["environment"]["DATABASE_URL"].startswith("postgres://")


def test_named_volumes_are_declared_and_used(compose: dict) -> None:
    declared = set(compose.get("volumes") or {})
    used = set()
    for svc in compose["services"].values():
        for volume in svc.get("volumes") or []:
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if not source.startswith((".", "/")):
                used.add(source)
    assert used == declared
    assert {"postgres-data", "redis-data"} <= declared


def test_build_targets_exist(compose: dict) -> None:
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if not build:
            continue
        assert build["context"] == ".."
        path = COMPOSE.parent / build["context"] / build["dockerfile"]
        assert path.is_file(), f"{name}: {path} missing"
        target = build.get("target")
        if target:
            parse_dockerfile(path).stage(target)


def test_agents_register_the_node_names_the_workers_claim_as(compose: dict) -> None:
    services = compose["services"]
    env = {name: svc.get("environment") or {} for name, svc in services.items()}
    assert env["agent"]["CRUCIBLE_NODE_NAME"] == env["worker-gpu"]["CRUCIBLE_NODE_NAME"]
    cpu_node = env["agent-cpu"]["CRUCIBLE_NODE_NAME"]
    assert cpu_node != env["agent"]["CRUCIBLE_NODE_NAME"]  # a node is one pool
    assert env["worker-cpu"]["CRUCIBLE_NODE_NAME"] == cpu_node
    assert env["worker-sandbox"]["CRUCIBLE_NODE_NAME"] == cpu_node
    assert env["agent-cpu"]["CRUCIBLE_NODE_POOL"] == "cpu"
    assert services["agent-cpu"]["profiles"] == ["scheduler"]
    # The cpu agent probes the sandbox, so it runs where the sandbox can: privileged, as root.
    assert services["agent-cpu"]["privileged"] is True
    assert services["agent-cpu"]["image"] == services["worker-sandbox"]["image"]
    assert env["agent"]["CRUCIBLE_NODE_PROBE"] == "none"


def test_s3_init_creates_the_bucket_once_against_a_real_s3_server(compose: dict) -> None:
    """Run s3-init's own script against moto's S3 server, as compose would: it creates the
    bucket OBJECT_STORE_URL names, and a second run (a restart) finds it and succeeds."""
    import os
    import subprocess
    import sys

    moto_server = pytest.importorskip("moto.server", reason="moto[server] missing: .[dev]")
    boto3 = pytest.importorskip("boto3")
    svc = compose["services"]["s3-init"]
    argv = svc["command"]
    assert argv[:2] == ["python", "-c"]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        # moto keeps one in-memory backend per process: buckets other tests made in this
        # process would show here, so start from an empty store.
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(
            f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=30).close()
        env = {**os.environ, **{k: str(v) for k, v in svc["environment"].items()},
               "S3_ENDPOINT_URL": f"http://{host}:{port}"}
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", argv[2]], env=env, capture_output=True,
                                  text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "bucket crucible ready" in done.stdout
        client = boto3.client("s3", endpoint_url=env["S3_ENDPOINT_URL"],
                              region_name=env["AWS_DEFAULT_REGION"],
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        assert [b["Name"] for b in client.list_buckets()["Buckets"]] == ["crucible"]
    finally:
        server.stop()
