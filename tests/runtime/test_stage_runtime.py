"""What an engine stage sets up in its process before serving."""

import asyncio
import sys

import grpc
import pytest

from conftest import write_config
from services.runtime.config import load_config


def test_an_engine_stage_shortens_the_interpreters_switch_interval(tiny_model, tmp_path):
    """The encoder stage, built in this process, runs with the engines' short switch interval."""
    from services.encoder.server import build
    from services.runtime.server import SWITCH_INTERVAL_S

    cfg = load_config(write_config(tmp_path / "mesh.yaml", tiny_model))
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)

    async def go() -> float:
        server = grpc.aio.server()
        stage = await build(cfg, 0, server)
        try:
            return sys.getswitchinterval()
        finally:
            await stage.close()

    try:
        assert asyncio.run(go()) == pytest.approx(SWITCH_INTERVAL_S) and SWITCH_INTERVAL_S < 0.005
    finally:
        sys.setswitchinterval(before)


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


class _Lockstep:
    """Three requests stepped together, twice: one output each per step, ending on the second."""

    def __init__(self):
        self.added = []

    def add(self, req) -> None:
        self.added.append(req)

    def ready(self, req) -> bool:
        return len(self.added) == 3 and not req.done

    def step(self, reqs):
        for r in self.added:
            r.steps += 1
            r.done = r.steps == 2
        return [(r, (r.name, r.steps)) for r in self.added]

    def free(self, req) -> None: ...


def test_a_steps_outputs_reach_the_server_in_one_wake_up():
    """Every output of a step, and the ends it brings, go to the server's event loop in one call (one write to its
    self-pipe, one turn of the loop), each request's in order."""
    import types

    from services.runtime.worker import EngineWorker

    async def go():
        loop = asyncio.get_running_loop()
        calls = []
        wake = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), wake(*a))[1]
        w = EngineWorker(_Lockstep(), "lockstep")
        try:
            handles = [w.submit(types.SimpleNamespace(name=n, steps=0, done=False)) for n in "abc"]
            got = [[x async for x in h.outputs()] for h in handles]
        finally:
            w.stop()
        return got, len(calls)

    got, wake_ups = asyncio.run(go())
    assert got == [[(n, 1), (n, 2)] for n in "abc"]
    assert wake_ups == 2  # was one per output and one per end: 9


def test_freezing_the_heap_takes_what_was_built_out_of_full_collections():
    """heap.freeze moves every live object to the permanent generation (a full pass no longer walks them);
    Pauses counts and times the collector's passes while installed, and only then."""
    import gc

    from services.runtime import heap

    built = [[i] for i in range(10_000)]  # long-lived containers, as a model's modules are
    try:
        frozen = heap.freeze()
        # Frozen objects still die by reference counting (a clean-clone CI run saw two go right after the freeze)
        assert frozen >= len(built) and len(built) <= gc.get_freeze_count() <= frozen
        with heap.Pauses() as pauses:
            gc.collect()
            gc.collect(0)
        assert pauses.count == 2 and 0 < pauses.max_ms <= pauses.total_ms
        gc.collect()
        assert pauses.count == 2 and pauses._on not in gc.callbacks
    finally:
        gc.unfreeze()
