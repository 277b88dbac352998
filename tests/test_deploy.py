"""The deployment examples under deploy/ parse, route by conversation, and configure a daemon that would start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.config import is_loopback, split_host, validate_config
from collector.errors import ConfigError
from judges import load_criteria

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COLLECTOR = DEPLOY / "collector-loadbalancing.yaml"
K8S = DEPLOY / "kubernetes" / "bot-with-tracejudge.yaml"


# --------------------------------------------------------------- the Collector config

@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    cfg = yaml.safe_load(COLLECTOR.read_text(encoding="utf-8"))
    assert isinstance(cfg, dict)
    return cfg


def test_collector_routes_on_the_conversation_id(collector: dict[str, Any]) -> None:
    lb = collector["exporters"]["load_balancing"]
    assert lb["routing_key"] == "attributes"
    # The exporter's key for the list is routing_attributes; it rejects routing_key: attributes without it.
    assert "gen_ai.conversation.id" in lb["routing_attributes"]
    assert "attributes" not in lb
    otlp = lb["protocol"]["otlp"]
    assert otlp["tls"]["insecure"] is True
    assert "endpoint" not in otlp  # filled in per backend by the load balancer


def test_collector_has_a_static_resolver_with_several_daemons(collector: dict[str, Any]) -> None:
    resolver = collector["exporters"]["load_balancing"]["resolver"]
    assert list(resolver) == ["static"]  # exactly one resolver; dns stays a comment
    hostnames = resolver["static"]["hostnames"]
    assert len(hostnames) >= 2 and len(set(hostnames)) == len(hostnames)
    for hostname in hostnames:
        host, port = split_host(hostname)
        assert host and port == 4317, hostname
    text = COLLECTOR.read_text(encoding="utf-8")
    assert "# dns:" in text and "#   port:" in text  # the commented alternative for a headless Service


def test_collector_pipelines_use_the_exporter(collector: dict[str, Any]) -> None:
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert split_host(protocols["grpc"]["endpoint"])[1] == 4317
    assert split_host(protocols["http"]["endpoint"])[1] == 4318
    pipelines = collector["service"]["pipelines"]
    for signal in ("traces", "logs"):
        pipeline = pipelines[signal]
        assert pipeline["receivers"] == ["otlp"]
        assert "load_balancing" in pipeline["exporters"]
    for pipeline in pipelines.values():  # everything a pipeline names is defined
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline.get(kind, []):
                assert name in (collector.get(kind) or {}), f"{kind} {name!r} is used but not defined"


# --------------------------------------------------------------- the Kubernetes example

@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(K8S.read_text(encoding="utf-8")) if d is not None]
    assert all(isinstance(d, dict) and "kind" in d and "apiVersion" in d for d in docs)
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment")["spec"]["template"]["spec"]


def _container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(c for c in _pod(docs)["containers"] if c["name"] == name)


def _mount_of(docs: list[dict[str, Any]], container: str, source: str) -> tuple[Path, dict[str, Any]]:
    """Where ``container`` mounts the volume backed by ``source`` (persistentVolumeClaim, configMap), and that volume."""
    volumes = {v["name"]: v for v in _pod(docs)["volumes"]}
    for mount in _container(docs, container)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if source in volume:
            return Path(mount["mountPath"]), volume[source]
    raise AssertionError(f"{container} mounts no {source} volume")


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def test_k8s_deployment_has_the_bot_and_tracejudge(k8s: list[dict[str, Any]]) -> None:
    deployment = _one(k8s, "Deployment")
    assert deployment["spec"]["replicas"] == 1  # one writer per DuckDB file
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert {c["name"] for c in _pod(k8s)["containers"]} == {"bot", "tracejudge"}

    bot = _container(k8s, "bot")
    assert bot["image"] == "example.com/support-bot:1.0"
    env = {e["name"]: e.get("value") for e in bot["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4318"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] == "SPAN_ONLY"
    assert "service.version=" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert "gen_ai.conversation.id" not in env["OTEL_RESOURCE_ATTRIBUTES"]  # one process, many conversations

    tj = _container(k8s, "tracejudge")
    assert tj["image"] == "example.com/tracejudge:latest"
    assert tj["command"] == ["tracejudge", "serve", "--config", "/etc/tracejudge/otel-config.yaml"]
    assert sorted(p["containerPort"] for p in tj["ports"]) == [4317, 4318, 8318]
    for container in (bot, tj):
        assert container["resources"]["limits"]["memory"], container["name"]


def test_k8s_data_volume_is_a_claim_mounted_for_the_daemon(k8s: list[dict[str, Any]]) -> None:
    mount, claim = _mount_of(k8s, "tracejudge", "persistentVolumeClaim")
    assert mount == Path("/var/lib/tracejudge")
    pvc = _one(k8s, "PersistentVolumeClaim")
    assert claim["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_k8s_probes_hit_the_health_endpoints_on_the_api_port(k8s: list[dict[str, Any]]) -> None:
    tj = _container(k8s, "tracejudge")
    ready, alive = tj["readinessProbe"]["httpGet"], tj["livenessProbe"]["httpGet"]
    assert ready["path"] == "/readyz" and alive["path"] == "/healthz"
    assert _port(tj, ready["port"]) == _port(tj, alive["port"]) == 8318
    assert "host" not in ready and "host" not in alive  # the kubelet probes the pod IP


def _daemon_config(k8s: list[dict[str, Any]]) -> tuple[Any, dict[str, Any], Path]:
    """The ConfigMap's otel-config.yaml validated as the daemon would: the config, the ConfigMap's data, its mount."""
    tj = _container(k8s, "tracejudge")
    mount, source = _mount_of(k8s, "tracejudge", "configMap")
    configmap = _one(k8s, "ConfigMap")
    assert source["name"] == configmap["metadata"]["name"]
    config_file = Path(tj["command"][tj["command"].index("--config") + 1])
    assert config_file.parent == mount
    data = configmap["data"]
    text = data[config_file.name]
    # load_config substitutes ${env:...} before validate_config; there is none here, so that step is a no-op.
    assert "${" not in text
    raw = yaml.safe_load(text)
    assert isinstance(raw, dict)
    # The environment the daemon sees: plain values as written, each Secret reference as a stand-in value.
    environ = {e["name"]: e.get("value") or f"<{e['name']} from its secret>" for e in tj.get("env", [])}
    try:
        cfg, warnings = validate_config(raw, base=mount, source=f"{K8S.name}: {config_file.name}", environ=environ)
    except ConfigError as exc:
        pytest.fail("the ConfigMap's otel-config.yaml does not validate:\n" + "\n".join(exc.problems))
    assert warnings == []
    return cfg, data, mount


def test_k8s_configmap_passes_the_config_validation(k8s: list[dict[str, Any]]) -> None:
    cfg, _, _ = _daemon_config(k8s)
    data_mount, _ = _mount_of(k8s, "tracejudge", "persistentVolumeClaim")
    tj = _container(k8s, "tracejudge")

    assert cfg.storage.duckdb.path == Path("/var/lib/tracejudge/tracejudge.duckdb")
    for written in (cfg.storage.duckdb.path, cfg.forward_dir, cfg.runtime_file, cfg.scenarios.out_dir):
        assert written.is_relative_to(data_mount), f"{written} is not on the volume"

    declared = {p["containerPort"] for p in tj["ports"]}
    for listener in (cfg.receivers.otlp.protocols.grpc, cfg.receivers.otlp.protocols.http):
        assert listener is not None
        host, port = split_host(listener.endpoint)
        assert is_loopback(host) and port in declared  # only the pod's own containers send
    host, port = split_host(cfg.api.endpoint)
    assert port == _port(tj, tj["readinessProbe"]["httpGet"]["port"])
    assert not is_loopback(host)  # else the kubelet's probes could not reach it
    assert cfg.api.auth.bearer_token  # required beyond loopback, from the Secret


def test_k8s_configmap_criteria_load(k8s: list[dict[str, Any]], tmp_path: Path) -> None:
    cfg, data, mount = _daemon_config(k8s)
    assert cfg.judges.criteria, "the example judges nothing"
    files = []
    for path in cfg.judges.criteria:
        assert path.parent == mount and path.name in data, f"{path} is not in the ConfigMap"
        (tmp_path / path.name).write_text(data[path.name], encoding="utf-8")
        files.append(tmp_path / path.name)
    assert load_criteria(files)
