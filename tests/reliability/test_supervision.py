"""Supervision: a stage that dies is started again while the others serve, what it left behind is cleaned up, one
that dies past the bound is left down; a stalled engine turns its health NOT_SERVING; callers reconnect at once."""

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client_util import error_of, generate
from conftest import free_ports, wait_until, write_config
from references import Case, native_thinker, png

TEXT = Case([("user", [("text", "Tell me a story about a cat.")])])
IMAGE = Case([("user", [("image", png(1)), ("text", "What is in this picture?")])])
# A killed stage serves again this soon, with no one's help: its imports and build take about 10 s on a quiet pair
# of cores
BACK_WITHIN_S = 15.0
# The request that needs each stage: text-only passes the gateway and thinker alone
NEEDS = {"gateway": (TEXT, False), "preprocess": (IMAGE, False), "encoder": (IMAGE, False), "thinker": (TEXT, False),
         "talker": (TEXT, True)}
ON_TEXT_PATH = ("gateway", "thinker")


@pytest.fixture(scope="module")
def mesh(tiny_model, tmp_path_factory):
    from services.launch import Mesh

    tmp = tmp_path_factory.mktemp("supervision")
    config = write_config(tmp / "mesh.yaml", tiny_model, encoders=1, preprocess={"workers": 1})
    m = Mesh(config, log_dir=tmp / "logs", supervise=True, max_restarts=3, unhealthy_s=10.0)
    m.start(timeout=180)
    yield m
    m.stop()


def ok(mesh, case: Case, speech: bool) -> bool:
    try:
        result = generate(mesh.gateway_address, case.request(speech=speech, max_tokens=4, frames=8), timeout=30)
    except grpc.RpcError:
        return False
    return result.finished is not None and (result.samples > 0 or not speech)


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (a preprocess stage's workers and resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Load:
    """Text-only requests one after another on a thread, each one's outcome kept."""

    def __init__(self, mesh):
        self.mesh, self.outcomes, self._stop = mesh, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.outcomes.append(ok(self.mesh, TEXT, False))
            time.sleep(0.5)

    def stop(self) -> list[bool]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.outcomes


@pytest.mark.parametrize("stage", list(NEEDS))
def test_a_killed_stage_serves_again_and_leaves_nothing_behind(mesh, stage):
    name = f"{stage}-0"
    case, speech = NEEDS[stage]
    assert ok(mesh, case, speech)
    pid = mesh.procs[name].pid
    left = children(pid)
    assert left or stage != "preprocess"  # its worker processes, to be ended with it
    load = Load(mesh)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    if stage == "talker":  # text-only is served while the talker is down; speech fails naming it
        assert ok(mesh, TEXT, False)
        err = error_of(mesh.gateway_address, TEXT.request(speech=True, max_tokens=4, frames=8))
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "talker" in err.details(), err
    if not wait_until(lambda: ok(mesh, case, speech), timeout=BACK_WITHIN_S, every=0.2):
        later = wait_until(lambda: ok(mesh, case, speech), timeout=60, every=0.2)
        pytest.fail(f"{name} not serving {BACK_WITHIN_S:.0f} s after its kill (serving {time.monotonic() - killed:.0f} s "
                    f"after: {bool(later)}):\n{mesh.log_tail(name)}")
    outcomes = load.stop()
    assert mesh.procs[name].pid != pid and not mesh.down()
    assert outcomes and (stage in ON_TEXT_PATH or all(outcomes)), outcomes
    assert ok(mesh, TEXT, False) and ok(mesh, IMAGE, False) and ok(mesh, TEXT, True)
    assert wait_until(lambda: not [p for p in left if alive(p)], timeout=10, every=0.1), [p for p in left if alive(p)]
    assert not list(Path("/dev/shm").glob(f"omni-*-{pid}"))


def test_a_wedged_stage_is_killed_and_started_again(mesh):
    """A stage that stops answering (SIGSTOP: health cannot answer) is wedged past the mesh's bound, then replaced."""
    pid = mesh.procs["encoder-0"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: mesh.procs["encoder-0"].pid != pid, timeout=mesh.unhealthy_s + 20, every=0.2)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: ok(mesh, IMAGE, False), timeout=BACK_WITHIN_S, every=0.2), mesh.log_tail("encoder-0")
    assert not alive(pid) and not mesh.down()


def test_a_stage_that_keeps_dying_is_left_down_while_the_others_serve(mesh):
    name, killed = "talker-0", set()
    deadline = time.monotonic() + 120
    while "talker-0" not in mesh.down() and time.monotonic() < deadline:  # each new talker killed as it starts
        proc = mesh.procs[name]
        if proc.pid not in killed and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed.add(proc.pid)
        time.sleep(0.05)
    assert mesh.down() == [name], (mesh.down(), killed)
    assert len(killed) >= 2  # restarted at least once before it was given up on
    pid = mesh.procs[name].pid
    time.sleep(3.0)  # past the backoff it would have had: it stays down
    assert mesh.procs[name].pid == pid and mesh.procs[name].poll() is not None
    assert ok(mesh, TEXT, False) and ok(mesh, IMAGE, False)
    err = error_of(mesh.gateway_address, TEXT.request(speech=True, max_tokens=4, frames=8))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "talker" in err.details(), err


def test_health_is_not_serving_while_the_engine_is_stalled(tiny_model):
    """A real thinker engine on a real EngineWorker, its step held on a gate: health says NOT_SERVING past the stall
    bound (not while merely idle), SERVING again once steps resume, and the wedged hook fires past the exit bound."""
    from services.llm.sampling import SamplingParams
    from services.runtime.server import watchdog
    from services.runtime.worker import EngineWorker
    from services.thinker.seq import ThinkerSeq

    engine = native_thinker(tiny_model)
    gate, real_step = threading.Event(), engine.step

    def gated_step(reqs):
        gate.wait()
        return real_step(reqs)

    engine.step = gated_step
    port = free_ports(1)[0]

    async def body():
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        worker, wedged = EngineWorker(engine, "thinker"), []
        watch = asyncio.create_task(watchdog(servicer, [""], worker.stalled_for, lambda: wedged.append(1),
                                             stall_s=3.0, exit_s=4.0, every=0.1))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)

        async def status():
            return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

        async def until(want, timeout):
            deadline = time.monotonic() + timeout
            while await status() != want and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return await status() == want

        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.sleep(4.5)  # idle past the bound: an idle engine is not a stalled one
        assert await status() == serving
        handle = worker.submit(ThinkerSeq("w", torch.tensor([1, 2, 3, 4, 5]), SamplingParams(max_tokens=4)))
        assert await until(not_serving, timeout=10)
        gate.set()
        outputs = [out async for out in handle.outputs()]
        assert outputs and await until(serving, timeout=5) and not wedged
        gate.clear()
        handle = worker.submit(ThinkerSeq("x", torch.tensor([1, 2, 3]), SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 20
        while not watch.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert wedged == [1] and await status() == not_serving
        gate.set()
        worker.cancel(handle)
        worker.stop()
        await channel.close()
        await server.stop(None)

    asyncio.run(body())


def test_a_router_reconnects_to_a_restarted_replica_within_a_second():
    """A replica's server goes away for a while, its calls failing meanwhile (gRPC's own backoff would grow to
    seconds), then serves again on its address: the router's channel calls it again within a second or so."""
    from services.gateway.router import Router
    from services.runtime.config import Replica

    port = free_ports(1)[0]

    async def serve():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    async def body():
        router = Router([Replica(port=port)], health_pb2_grpc.HealthStub, stage="talker")
        stub = router.endpoints[0].stub

        async def answers() -> bool:
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                return True
            except grpc.aio.AioRpcError:
                return False

        server = await serve()
        assert await answers()
        await server.stop(None)
        for _ in range(20):  # 10 s of failing calls, as a gateway's requests keep coming
            assert not await answers()
            await asyncio.sleep(0.5)
        server = await serve()
        back = time.monotonic()
        while not await answers():
            await asyncio.sleep(0.02)
        assert time.monotonic() - back < 2.0
        await router.close()
        await server.stop(None)

    asyncio.run(body())
