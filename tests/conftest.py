import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere; run on the H200)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def wait_until(predicate, timeout: float, every: float = 0.01):
    """Polls `predicate` until it holds or `timeout` seconds have passed; its last value (falsy: timed out)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(every)
    return value


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from services.model.build import build_tiny

    return build_tiny(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from references import load_hf

    return load_hf(tiny_model)


def write_config(path: Path, model_dir: Path, encoders: int = 2, with_talker: bool = True, thinkers: int = 1,
                 **overrides) -> Path:
    ports = iter(free_ports(32))

    def replicas(n, **extra):
        return [{"port": next(ports), "metrics_port": next(ports), **extra} for _ in range(n)]

    enc = replicas(encoders)
    if encoders == 2:
        enc[0]["prefer_for"], enc[1]["prefer_for"] = ["text"], ["audio"]
    think = replicas(thinkers)
    if thinkers == 2:
        think[0]["prefer_for"], think[1]["prefer_for"] = ["text"], ["audio"]
    cfg = {
        "model": {"path": str(model_dir), "dtype": "float32", "name": "tiny"},
        "limits": {"max_request_bytes": 4 << 20, "max_media_items": 4, "max_image_pixels": 1 << 20,
                   "max_audio_seconds": 20, "max_video_frames": 8, "max_new_tokens": 256, "max_talker_frames": 1024,
                   "max_context_tokens": 512},
        "transport": {"pool_bytes": 64 << 20},
        "gateway": {"replicas": replicas(1)},
        "preprocess": {"replicas": replicas(1)},
        "encoder": {"replicas": enc},
        "thinker": {"replicas": think},
        "talker": {"replicas": replicas(1) if with_talker else [], "chunks": [4, 8]},
    }
    for key, value in overrides.items():
        cfg.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _running_mesh(tmp, model, **overrides):
    from services.launch import Mesh

    m = Mesh(write_config(tmp / "mesh.yaml", model, **overrides), log_dir=tmp / "logs")
    m.start(timeout=180)
    return m


@pytest.fixture(scope="session")
def mesh(tiny_model, tmp_path_factory):
    """The mesh with the reference engines (transformers' modules)."""
    m = _running_mesh(tmp_path_factory.mktemp("mesh"), tiny_model, thinker={"engine": "reference"},
                      talker={"engine": "reference"})
    yield m
    codes = m.stop()
    assert all(c == 0 for c in codes.values()), f"stages did not stop cleanly: {codes}"


@pytest.fixture(scope="session")
def native_mesh(tiny_model, tmp_path_factory):
    """The mesh as served (the native engines), with small blocks and step budgets: requests share steps and
    their prompts are chunked."""
    small = {"block_size": 8, "max_batched_tokens": 64, "kv_blocks": 256}
    m = _running_mesh(tmp_path_factory.mktemp("native"), tiny_model, thinker=small, talker=small)
    yield m
    codes = m.stop()
    assert all(c == 0 for c in codes.values()), f"stages did not stop cleanly: {codes}"


@pytest.fixture(params=["reference", "native"])
def any_mesh(request):
    """Each equivalence test runs against both thinker engines."""
    return request.getfixturevalue("mesh" if request.param == "reference" else "native_mesh")
