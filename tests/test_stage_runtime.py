"""What an engine stage sets up in its process before serving."""

import asyncio
import sys

import grpc
import pytest

from conftest import write_config
from services.runtime.config import ConfigError, load_config


def test_an_engine_stage_shortens_the_interpreters_switch_interval(tiny_model, tmp_path):
    """The encoder stage, built in this process from a config asking for 0.25 ms, runs with it."""
    from services.encoder.server import build

    cfg = load_config(write_config(tmp_path / "mesh.yaml", tiny_model, encoder={"switch_interval_ms": 0.25}))
    before = sys.getswitchinterval()

    async def go() -> float:
        server = grpc.aio.server()
        stage = await build(cfg, 0, server)
        try:
            return sys.getswitchinterval()
        finally:
            await stage.close()

    try:
        assert asyncio.run(go()) == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(before)


def test_a_switch_interval_must_be_positive(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="talker.switch_interval_ms must be positive"):
        load_config(write_config(tmp_path / "mesh.yaml", tiny_model, talker={"switch_interval_ms": 0}))


class _DeviceProbe:
    """An engine that reports which device its thread was on when it stepped."""

    def __init__(self, device: str):
        self.device = device

    def add(self, req) -> None: ...

    def ready(self, req) -> bool:
        return not req.done

    def step(self, reqs):
        import torch

        for r in reqs:
            r.done = True
        return [(r, torch.cuda.current_device()) for r in reqs]

    def free(self, req) -> None: ...


def test_the_engine_thread_and_the_server_thread_work_on_the_replicas_gpu(monkeypatch):
    """CUDA's current device is per thread and GPU0 unless set: a stage on GPU1 whose threads did not select it
    recorded its events on GPU0's stream (its waits then waited for nothing). Here torch's device selection is
    stood in for (this machine has no GPU): both the engine's thread and the thread that serves select the
    replica's device before their first step."""
    import threading
    import types

    import torch

    from services.runtime import worker as worker_mod

    current = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), str(d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current.get(threading.get_ident(), "cuda:0"))

    async def go():
        w = worker_mod.EngineWorker(_DeviceProbe("cuda:1"), "probe")
        try:
            return [x async for x in w.submit(types.SimpleNamespace(done=False)).outputs()]
        finally:
            w.stop()

    assert asyncio.run(go()) == ["cuda:1"]
    worker_mod.use_device("cuda:1")
    assert current[threading.get_ident()] == "cuda:1"
    worker_mod.use_device("cpu")  # nothing to select on the CPU
    assert current[threading.get_ident()] == "cuda:1"
