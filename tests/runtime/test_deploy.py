"""The 2xH200 deployment files agree with configs/2xh200.yaml and services/runtime/metrics.py (no Docker needed)."""

import copy
import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from services.runtime import metrics
from services.runtime.config import MeshConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG_IN_IMAGE = "/app/configs/2xh200.yaml"


@pytest.fixture(scope="module")
def cfg() -> MeshConfig:
    return load_config(ROOT / "configs" / "2xh200.yaml")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((ROOT / "docker" / "grafana" / "dashboards" / "omni.json").read_text())


def replicas(cfg: MeshConfig):
    for stage in cfg.STAGES:
        for i, r in enumerate(cfg.replicas(stage)):
            yield stage, i, r


def argv(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def published(service: dict) -> list[tuple[int, int]]:
    """(host port, container port) of every published port, short or long syntax."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((int(p["published"]), int(p["target"])))
        else:
            *host, container = str(p).split("/")[0].split(":")
            out.append((int(host[-1]) if host else int(container), int(container)))
    return out


def gpu_requests(service: dict) -> list[dict]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" or "gpu" in d.get("capabilities", [])]


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of every volume, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append((v.get("source", ""), v["target"], bool(v.get("read_only"))))
        else:
            head, last = v.rsplit(":", 1)  # the source may hold ':' itself (${VAR:-default})
            (source, target), mode = ((head, last), "") if last.startswith("/") else (head.rsplit(":", 1), last)
            out.append((source, target, "ro" in mode.split(",")))
    return out


# --- checks, each taking parsed documents, so that the mutation tests below can feed them broken copies ---

def check_services(cfg: MeshConfig, compose: dict) -> None:
    services = compose["services"]
    hosts = [r.host for _, _, r in replicas(cfg)]
    assert len(hosts) == len(set(hosts)), f"two replicas share a host: {hosts}"
    assert set(hosts) <= set(services), f"replicas without a compose service: {sorted(set(hosts) - set(services))}"
    extra = set(services) - set(hosts) - {"prometheus", "grafana"}
    assert not extra, f"services that are no replica of the config: {sorted(extra)}"
    for stage, i, r in replicas(cfg):
        s = services[r.host]
        expected = ["python", "-m", f"services.{stage}", "--config", CONFIG_IN_IMAGE, "--replica", str(i)]
        assert argv(s["command"]) == expected, f"{r.host}: command {s['command']}"
        assert s["build"]["dockerfile"] == "docker/Dockerfile" and s["build"].get("context", ".") == ".", r.host
        assert s.get("ipc") == "host", f"{r.host}: tensors cross containers through /dev/shm and CUDA IPC: needs ipc: host"
        assert s.get("pid") == "host", f"{r.host}: pool names hold the pid: needs pid: host"
        assert s.get("restart") == "unless-stopped", r.host
        assert s.get("network_mode") is None, f"{r.host}: stages reach each other by service name"


def check_healthchecks(cfg: MeshConfig, compose: dict) -> None:
    for stage, _, r in replicas(cfg):
        hc = compose["services"][r.host].get("healthcheck")
        assert hc and not hc.get("disable"), f"{r.host}: no healthcheck"
        test = argv(hc["test"])
        if test[0] in ("CMD", "CMD-SHELL"):
            test = test[1:] if test[0] == "CMD" else shlex.split(" ".join(test[1:]))
        http = ["--http"] if stage in cfg.HTTP_STAGES else []
        command = argv(compose["services"][r.host]["command"])
        config = command[command.index("--config") + 1]  # the probe reads the stage's own config, for its TLS
        expected = ["python", "-m", "services.runtime.probe", r.address, "--config", config, *http]
        assert test == expected, f"{r.host}: healthcheck {hc['test']}"
        assert int(hc["retries"]) >= 1 and seconds(hc["timeout"]) < seconds(hc["interval"]), r.host
        least = 300 if r.device.startswith("cuda") else 30  # loading weights on a GPU takes minutes
        assert seconds(hc["start_period"]) >= least, f"{r.host}: start_period {hc['start_period']} < {least}s"


def check_gpus(cfg: MeshConfig, compose: dict) -> None:
    gpus = sorted({int(r.device.split(":")[1]) for _, _, r in replicas(cfg) if r.device.startswith("cuda")})
    for stage, _, r in replicas(cfg):
        s = compose["services"][r.host]
        requests = gpu_requests(s)
        env = s.get("environment", {})
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
        assert "CUDA_VISIBLE_DEVICES" not in env and "NVIDIA_VISIBLE_DEVICES" not in env, f"{r.host}: renumbers GPUs"
        if not r.device.startswith("cuda"):
            assert not requests and "gpus" not in s and s.get("runtime") != "nvidia", f"{r.host}: CPU stage holds a GPU"
            continue
        n = int(r.device.split(":")[1])
        assert len(requests) == 1, f"{r.host}: expected one GPU reservation, got {requests}"
        ids = [str(d) for d in requests[0].get("device_ids", [])]
        assert "count" not in requests[0] and "gpu" in requests[0]["capabilities"], r.host
        # Every GPU of the host, in host order: cuda:N inside is host GPU N, and peers' IPC handles open.
        assert ids == [str(g) for g in gpus], f"{r.host}: reserves GPUs {ids}, the mesh uses {gpus}"
        assert n < len(ids) and ids[n] == str(n), f"{r.host}: {r.device} is not host GPU {n} inside the container"
        assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID", f"{r.host}: cuda:N must follow the host's GPU numbering"


def check_model_mount(cfg: MeshConfig, compose: dict) -> None:
    for stage, _, r in replicas(cfg):
        found = [m for m in mounts(compose["services"][r.host]) if m[1] == cfg.model.path]
        assert len(found) == 1, f"{r.host}: the checkpoint is not mounted at {cfg.model.path}"
        source, _, read_only = found[0]
        assert read_only, f"{r.host}: the checkpoint must be mounted read-only"
        assert "OMNI_MODEL_DIR" in source, f"{r.host}: the checkpoint's host path comes from OMNI_MODEL_DIR"


def check_ports(cfg: MeshConfig, compose: dict) -> None:
    services = compose["services"]
    gw = cfg.gateway.replicas[0]
    assert any(c == gw.port for _, c in published(services[gw.host])), f"gateway does not publish {gw.port}"
    for r in cfg.api.replicas:
        assert any(c == r.port for _, c in published(services[r.host])), f"{r.host} does not publish {r.port}"
    host_ports = [h for s in services.values() for h, _ in published(s)]
    assert len(host_ports) == len(set(host_ports)), f"a host port is published twice: {sorted(host_ports)}"
    for _, _, r in replicas(cfg):
        listens = {r.port, r.metrics_port}
        assert len(listens) == 2, f"{r.host}: gRPC and metrics on one port"
        for _, container in published(services[r.host]):
            assert container in listens, f"{r.host}: publishes {container}, which it does not listen on"
    deps = services[gw.host].get("depends_on", {})
    others = {r.host for stage, _, r in replicas(cfg) if stage not in ("gateway", *cfg.HTTP_STAGES)}
    assert isinstance(deps, dict) and set(deps) == others, f"gateway must wait for {sorted(others)}"
    assert all(d.get("condition") == "service_healthy" for d in deps.values()), "gateway must wait until stages serve"
    for r in cfg.api.replicas:  # the HTTP door is a client of the gateway: it starts once the gateway serves
        assert services[r.host].get("depends_on") == {gw.host: {"condition": "service_healthy"}}, r.host


def check_prometheus(cfg: MeshConfig, prometheus: dict) -> None:
    assert seconds(prometheus["global"]["scrape_interval"]) == 5
    jobs = {}
    for job in prometheus["scrape_configs"]:
        assert job["job_name"] not in jobs, f"job {job['job_name']} twice"
        jobs[job["job_name"]] = [t for sc in job["static_configs"] for t in sc["targets"]]
    expected = {stage: sorted(f"{r.host}:{r.metrics_port}" for r in cfg.replicas(stage)) for stage in cfg.STAGES
                if cfg.replicas(stage)}
    assert {k: sorted(v) for k, v in jobs.items()} == expected


def metric_names() -> set[str]:
    """Every series name the collectors of services/runtime/metrics.py expose."""
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                names |= {family.name + s for s in suffixes[family.type]}
    return names


def check_dashboard(dashboard: dict, datasource_uid: str) -> None:
    known = metric_names()
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == datasource_uid, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == datasource_uid, p["title"]
            used = set(re.findall(r"\bomni_\w+", t["expr"]))
            assert used, f"{p['title']}: {t['expr']} uses no omni metric"
            assert used <= known, f"{p['title']}: unknown metric(s) {sorted(used - known)}"


# --- the real files ---

def test_config_is_the_2xh200_layout(cfg):
    assert cfg.model.path == "/models/qwen3-omni" and cfg.model.dtype == "bfloat16"
    assert {r.device for _, _, r in replicas(cfg)} == {"cpu", "cuda:0", "cuda:1"}
    assert cfg.thinker.replicas[0].device != cfg.talker.replicas[0].device
    for r in cfg.encoder.replicas:  # an encoder is preferred for the output path that leaves its GPU idle
        busy_with_talker = any(t.device == r.device for t in cfg.talker.replicas)
        assert r.prefer_for == (["text"] if busy_with_talker else ["audio"]), r.host


def test_the_deployment_serves_the_engines_the_benchmark_measures(cfg):
    """configs/2xh200.yaml (docker compose) and configs/bench-2xh200.yaml (the sweep) run the thinker and the
    talker with the same settings, replicas and transport aside: the committed figures are what users get."""
    bench = load_config(ROOT / "configs" / "bench-2xh200.yaml")
    for stage in ("thinker", "talker", "encoder", "preprocess"):
        ours, theirs = dataclasses.asdict(getattr(cfg, stage)), dataclasses.asdict(getattr(bench, stage))
        ours.pop("replicas"), theirs.pop("replicas")
        assert ours == theirs, stage
    assert cfg.thinker.engine == cfg.talker.engine == "native"


def test_services(cfg, compose):
    check_services(cfg, compose)


def test_healthchecks(cfg, compose):
    check_healthchecks(cfg, compose)


def test_gpu_reservations(cfg, compose):
    check_gpus(cfg, compose)


def test_model_mount(cfg, compose):
    check_model_mount(cfg, compose)


def test_ports(cfg, compose):
    check_ports(cfg, compose)


def test_only_the_doors_leave_the_mesh_network(cfg, compose):
    """Internal stages sit on an internal network alone and publish nothing; the gateway and the door join the
    public one too."""
    assert compose["networks"]["mesh"].get("internal") is True
    doors = {cfg.gateway.replicas[0].host} | {r.host for r in cfg.api.replicas}
    for _, _, r in replicas(cfg):
        service = compose["services"][r.host]
        nets = sorted(service.get("networks", []))
        if r.host in doors:
            assert nets == ["mesh", "public"], f"{r.host}: networks {nets}"
        else:
            assert nets == ["mesh"] and not service.get("ports"), f"{r.host}: networks {nets}, ports {service.get('ports')}"


def test_prometheus(cfg, prometheus):
    check_prometheus(cfg, prometheus)


def test_observability_services(compose):
    services = compose["services"]
    for name, target in (("prometheus", "/etc/prometheus/prometheus.yml"), ("grafana", "/etc/grafana/provisioning")):
        for source, mounted_at, _ in mounts(services[name]):
            assert (ROOT / source).exists(), f"{name}: {source} is not in the repository"
        assert target in [m[1] for m in mounts(services[name])], f"{name}: nothing mounted at {target}"
    env = services["grafana"]["environment"]
    assert str(env["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "true"
    assert {9090, 3000} <= {h for s in services.values() for h, _ in published(s)}


def test_dashboard(dashboard):
    ds = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/dashboards.yml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert ("./docker/grafana/dashboards", provider["options"]["path"]) in [m[:2] for m in mounts(compose["services"]["grafana"])]
    check_dashboard(dashboard, ds[0]["uid"])


def test_image():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pytorch/pytorch:" in dockerfile, "a CUDA build of torch comes from an official PyTorch image"
    assert "grep -v '^torch' " in dockerfile, "torch comes from the base image, never from requirements.txt"
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M) and re.search(r"^COPY \. /app$", dockerfile, re.M)
    assert "PYTHONPATH=/app" in dockerfile and "PYTHONUNBUFFERED=1" in dockerfile
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert {".git", ".venv", ".cache", "models"} <= set(ignored) and "configs" not in ignored


# --- the checks can fail: each broken copy must be caught ---

def _set(path: str, value):
    def mutate(doc):
        *keys, last = path.split("/")
        for k in keys:
            doc = doc[int(k) if isinstance(doc, list) else k]
        if value is KeyError:
            del doc[last]
        else:
            doc[int(last) if isinstance(doc, list) else last] = value
    return mutate


COMPOSE_MUTATIONS = {
    "wrong replica index": (check_services, _set("services/encoder-1/command/6", "0")),
    "wrong stage module": (check_services, _set("services/talker-0/command/2", "services.thinker")),
    "wrong config file": (check_services, _set("services/preprocess-1/command/4", "/app/configs/local.yaml")),
    "missing service": (check_services, _set("services/preprocess-1", KeyError)),
    "no ipc host": (check_services, _set("services/thinker-0/ipc", KeyError)),
    "probe of another replica": (check_healthchecks, _set("services/encoder-0/healthcheck/test/4", "encoder-1:50072")),
    "probe of the metrics port": (check_healthchecks, _set("services/gateway/healthcheck/test/4", "gateway:9100")),
    "gpu only by its own id": (check_gpus, _set("services/encoder-1/deploy/resources/reservations/devices/0/device_ids", ["1"])),
    "gpu on a cpu stage": (check_gpus, lambda d: d["services"]["preprocess-0"].update(deploy=d["services"]["thinker-0"]["deploy"])),
    "renumbered gpus": (check_gpus, _set("services/talker-0/environment", {"CUDA_VISIBLE_DEVICES": "1"})),
    "checkpoint writable": (check_model_mount, _set("services/talker-0/volumes/0", "${OMNI_MODEL_DIR}:/models/qwen3-omni")),
    "checkpoint elsewhere": (check_model_mount, _set("services/gateway/volumes/0", "${OMNI_MODEL_DIR}:/models/other:ro")),
    "gateway unpublished": (check_ports, _set("services/gateway/ports", [])),
    "port published twice": (check_ports, _set("services/grafana/ports", ["50051:3000"])),
    "gateway starts early": (check_ports, _set("services/gateway/depends_on/thinker-0/condition", "service_started")),
    "api starts before the gateway": (check_ports, _set("services/api/depends_on/gateway/condition", "service_started")),
    "api probed over gRPC": (check_healthchecks, _set("services/api/healthcheck/test", ["CMD", "python", "-m", "services.runtime.probe", "api:8000"])),
    "api unpublished": (check_ports, _set("services/api/ports", [])),
}


@pytest.mark.parametrize("name", COMPOSE_MUTATIONS)
def test_broken_compose_fails(cfg, compose, name):
    check, mutate = COMPOSE_MUTATIONS[name]
    broken = json.loads(json.dumps(compose))  # unshares what YAML anchors share, so one service breaks alone
    mutate(broken)
    with pytest.raises(AssertionError):
        check(cfg, broken)


def test_broken_prometheus_and_dashboard_fail(cfg, prometheus, dashboard):
    broken = copy.deepcopy(prometheus)
    broken["scrape_configs"][2]["static_configs"][0]["targets"] = ["encoder-0:9111", "encoder-1:9111"]
    with pytest.raises(AssertionError):
        check_prometheus(cfg, broken)
    broken = copy.deepcopy(dashboard)
    broken["panels"][0]["targets"][0]["expr"] = "sum(rate(omni_requests_count[1m]))"  # a counter has no _count
    with pytest.raises(AssertionError):
        check_dashboard(broken, "omni-prometheus")
    with pytest.raises(AssertionError):
        check_dashboard(dashboard, "another-datasource")
