"""docker-compose.yml, read as the Docker engine would: no engine runs here, so a test keeps it honest."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from chat_api.cli.main import build_parser
from chat_api.replies.drain import graceful_shutdown_seconds
from memory.config import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
CHATMEM_IMAGE = "chatmem:latest"

# Variables that are not chatmem settings but are read by something in the image.
INFRA_VARS = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # type: ignore[no-any-return]


def services_of(compose: dict[str, Any], image: str) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("image") == image}


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", ["serve"])
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def env_of(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return dict(env)


def test_every_chatmem_variable_is_a_setting_the_code_reads(compose: dict[str, Any]) -> None:
    settings = {name.upper() for name in Settings.model_fields}
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        unknown = set(env_of(service)) - settings - INFRA_VARS
        assert not unknown, f"{name}: {sorted(unknown)} are not fields of memory.config.Settings"


def container_environment(service: dict[str, Any]) -> dict[str, str]:
    """What the container's environment holds (interpolated values get their defaults)."""
    values: dict[str, str] = {}
    for key, value in env_of(service).items():
        if key in INFRA_VARS or value is None:
            continue
        text = str(value)
        default = re.fullmatch(r"\$\{[A-Z_]+:-(.*)\}", text)
        if default:
            text = default.group(1)
        elif "${" in text:
            text = "x" * 40  # a required secret from the shell
        values[key] = text
    return values


def settings_in(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the service's processes read: from the environment, as the container has it."""
    with monkeypatch.context() as env:
        for key in Settings.model_fields:
            env.delenv(key.upper(), raising=False)
        for key, text in container_environment(service).items():
            env.setenv(key, text)
        return Settings(_env_file=None)  # type: ignore[call-arg]


def test_fixed_values_are_valid_settings(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service's values build a valid Settings, read from the environment as in the container."""
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        settings = settings_in(service, monkeypatch)
        assert (settings.database_url or "").startswith("postgresql+asyncpg://"), name
        assert "@postgres:5432/" in (settings.database_url or ""), name


def test_commands_are_chatmem_commands(compose: dict[str, Any]) -> None:
    chatmem = services_of(compose, CHATMEM_IMAGE)
    parser = build_parser()
    commands = {}
    for name, service in chatmem.items():
        argv = command_of(service)
        parser.parse_args(argv)  # exits (fails the test) on an unknown command or option
        commands[name] = argv[0] if argv[0] != "db" else " ".join(argv[:2])
    assert sorted(commands.values()).count("serve") == 2, "two API replicas"
    assert "relay" in commands.values()
    assert "indexer" in commands.values()
    assert "db upgrade" in commands.values()


def test_api_replicas_listen_on_distinct_ports_and_on_all_interfaces(compose: dict[str, Any]) -> None:
    apis = {n: s for n, s in services_of(compose, CHATMEM_IMAGE).items() if command_of(s)[0] == "serve"}
    host_ports = []
    for name, service in apis.items():
        argv = command_of(service)
        host = argv[argv.index("--host") + 1] if "--host" in argv else env_of(service).get("HOST")
        assert host == "0.0.0.0", f"{name} must listen beyond the container's loopback"
        port = argv[argv.index("--port") + 1] if "--port" in argv else env_of(service).get("PORT", "8000")
        published = [str(p) for p in service.get("ports", [])]
        assert len(published) == 1 and published[0].endswith(f":{port}"), name
        host_ports.append(published[0].split(":")[0])
        assert str(port) in " ".join(service["healthcheck"]["test"]), f"{name} checks another port"
    assert len(set(host_ports)) == len(apis) == 2


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        one_shot = service.get("restart") == "no"
        if not one_shot:
            check = service.get("healthcheck")
            assert check and check.get("test"), f"{name} has no healthcheck"


def test_dependencies_wait_for_the_right_condition(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions, not a bare list"
        for dependency, rule in depends.items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            condition = rule.get("condition")
            assert condition in CONDITIONS, f"{name} → {dependency}: {condition}"
            target = services[dependency]
            if condition == "service_healthy":
                assert "healthcheck" in target, f"{name} waits for {dependency} health, which has no check"
            if condition == "service_completed_successfully":
                assert target.get("restart") == "no", f"{dependency} must be one-shot"
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        if command_of(service)[:2] == ["db", "upgrade"]:
            assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
            continue
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
        if command_of(service)[0] in ("relay", "indexer"):
            assert any(dep.startswith("kafka") for dep in service["depends_on"]), name


def test_postgres_has_pgvector_and_kafka_runs_in_kraft_mode(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["postgres"]["image"] == "pgvector/pgvector:pg17"
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = env_of(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "zookeeper" not in yaml.safe_dump(compose).lower()
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@kafka:")
    advertised = env["KAFKA_ADVERTISED_LISTENERS"]
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        bootstrap = env_of(service).get("KAFKA_BOOTSTRAP_SERVERS")
        assert bootstrap and bootstrap in advertised, f"{name} bootstraps from {bootstrap}, not {advertised}"
    partitions = re.search(r"--partitions (\d+)", " ".join(command_of(services["kafka-init"])))
    assert partitions is not None and int(partitions[1]) >= 2


def test_an_api_replica_is_given_the_time_its_shutdown_drain_takes(compose: dict[str, Any]) -> None:
    """The engine sent SIGKILL 20 s after SIGTERM, mid-drain: replies were left to a reaper, streams cut."""
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        if command_of(service)[0] != "serve":
            continue
        drain = env_of(service).get(
            "SHUTDOWN_DRAIN_SECONDS", Settings.model_fields["shutdown_drain_seconds"].default
        )
        settings = Settings.model_construct(shutdown_drain_seconds=float(drain))
        grace = int(str(service["stop_grace_period"]).removesuffix("s"))
        assert grace > graceful_shutdown_seconds(settings), name


def test_imported_history_had_no_topic_every_topic_the_code_uses_is_created(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker creates no topic by itself (auto-create off): kafka-init makes every one the
    relay publishes to and the indexer reads, each service's as its settings name it."""
    services = compose["services"]
    assert env_of(services["kafka"])["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    init = command_of(services["kafka-init"])
    loop = re.search(r"for topic in ([^;]+);", " ".join(init))
    assert loop is not None, "kafka-init creates its topics in one loop"
    created = set(loop[1].split())
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        settings = settings_in(service, monkeypatch)
        used = {settings.kafka_topic, settings.history_topic, settings.kafka_dlq_topic}
        assert used <= created, f"{name} uses {sorted(used - created)}, which kafka-init does not create"


def test_scalable_workers_pin_no_host_port_or_name(compose: dict[str, Any]) -> None:
    for name in ("indexer", "relay"):
        service = compose["services"][name]
        assert "ports" not in service and "container_name" not in service, f"{name} could not be scaled"


def test_dockerfile_is_slim_non_root_and_runs_chatmem() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.MULTILINE)
    users = re.findall(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["chatmem"]' in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile, "torch must come from the CPU index"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_indexer_healthcheck_read_its_metrics_not_whether_it_can_index(compose: dict[str, Any]) -> None:
    """An indexer refusing memory (an encoder it cannot load) or without its queue was healthy:
    its check fetched /metrics. It asks /readyz on its METRICS_PORT; the relay, /healthz."""
    for name, service in services_of(compose, CHATMEM_IMAGE).items():
        which = command_of(service)[0]
        if which not in ("indexer", "relay"):
            continue
        check = " ".join(service["healthcheck"]["test"])
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", check)
        assert url is not None, name
        assert url[1] == str(env_of(service)["METRICS_PORT"]), name
        assert url[2] == ("/readyz" if which == "indexer" else "/healthz"), name
