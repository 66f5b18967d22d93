"""The HTTP door's processes for the tests: api processes (services.api, started by the launcher) in front of the
session's reference mesh, or of a gateway the test itself plays (tests/api/fake_gateway.py)."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import free_ports


@dataclass
class Door:
    url: str  # http://host:port
    metrics_port: int
    cfg_path: Path
    mesh: object  # the services.launch.Mesh running this api process

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def start_api(mesh_config: Path, tmp: Path, name: str, gateway: str | None = None, security: dict | None = None,
              **api) -> Door:
    """An api process reading `mesh_config` (its gateway replaced by `gateway` when given) plus an api section (and a
    security one)."""
    from services.launch import Mesh

    cfg = yaml.safe_load(mesh_config.read_text())
    port, metrics_port = free_ports(2)
    cfg["api"] = {"replicas": [{"port": port, "metrics_port": metrics_port}], **api}
    if security is not None:
        cfg["security"] = security
    if gateway is not None:
        host, gport = gateway.rsplit(":", 1)
        cfg["gateway"]["replicas"] = [{"host": host, "port": int(gport), "metrics_port": free_ports(1)[0]}]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    m = Mesh(path, log_dir=tmp / f"{name}-logs", stages=("api",))
    m.start(timeout=60)
    return Door(f"http://127.0.0.1:{port}", metrics_port, path, m)


def stop(door: Door) -> None:
    codes = door.mesh.stop()
    assert all(c == 0 for c in codes.values()), f"the api process did not stop cleanly: {codes}"


@pytest.fixture(scope="session")
def api(mesh, tmp_path_factory) -> Door:
    """An api process in front of the session's reference mesh, with the deployment's defaults."""
    door = start_api(mesh.config_path, tmp_path_factory.mktemp("api"), "api")
    yield door
    stop(door)


@pytest.fixture(scope="session")
def client(api):
    from openai import OpenAI

    # No retries: a test sees each answer as the server gave it.
    return OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=120)
