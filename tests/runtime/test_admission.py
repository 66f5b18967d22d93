"""Admission in one process: the gateway's gate (slots, a bounded queue, refusals with a retry hint, callers that
leave while waiting), an engine worker's bound and its skipping of cancelled and stalled requests, and the status
an RPC ends with (RetryInfo in the details; a deadline counted as DEADLINE_EXCEEDED, not CANCELLED)."""

import asyncio
import types

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from omni.stage.v1 import load_pb2, load_pb2_grpc
from services.runtime import metrics
from services.runtime.admission import Gate, Limit, Overloaded, slots, stage_slots
from services.runtime.config import MeshConfig, Replica
from services.runtime.worker import OUTPUT_BOUND, EngineWorker


def test_slots_come_from_the_batch_and_the_kv_cache():
    assert slots(types.SimpleNamespace(max_seqs=8, kv_blocks=0)) == 8
    assert slots(types.SimpleNamespace(max_seqs=8, kv_blocks=3)) == 3  # a sequence holds a block at least
    cfg = MeshConfig()
    cfg.thinker.max_seqs, cfg.thinker.replicas = 8, [Replica(), Replica()]
    assert stage_slots(cfg, "thinker") == 8
    assert stage_slots(cfg, "encoder") == 16 + 8  # all the gateway admits for the thinkers: none refused behind


def test_a_waiter_that_cannot_finish_before_its_deadline_is_refused_at_once():
    limit = Limit("x", 2, 1)
    limit.held(1.0)
    limit.check(0, 1, 0.01)  # a free slot: no wait
    limit.check(0, 1, 0.5)  # it starts at once, though it may not finish: its own deadline ends it
    limit.check(0, 2, 5.0)
    with pytest.raises(Overloaded, match="before its deadline") as e:
        limit.check(0, 2, 1.2)  # half a hold (two slots) to wait and a hold, 1.2 s left
    assert e.value.retry_after == pytest.approx(0.5)
    limit.check(0, 2, 1.6)
    with pytest.raises(Overloaded, match="at capacity"):
        limit.check(1, 2, None)


def test_the_gate_queues_in_order_and_forgets_who_left():
    async def go():
        gate = Gate("x", 1, 2)
        order, release = [], asyncio.Event()

        async def user(name):
            async with gate.enter(None):
                order.append(name)
                await release.wait()

        first = asyncio.create_task(user("a"))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(user(n)) for n in "bc"]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            async with gate.enter(None):
                pass
        waiting[0].cancel()  # left while queued: costs no slot
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, waiting[1], return_exceptions=True)
        return order, gate.running, len(gate.waiters)

    assert asyncio.run(go()) == (["a", "c"], 0, 0)


class _Counting:
    """Steps every request it is given by one output; records what it was asked to add and step."""

    def __init__(self):
        self.added, self.stepped, self.freed = [], [], []

    def add(self, req):
        self.added.append(req.name)

    def ready(self, req):
        return not req.done

    def step(self, reqs):
        self.stepped.append(sorted(r.name for r in reqs))
        return [(r, r.name) for r in reqs]

    def free(self, req):
        self.freed.append(req.name)


def test_a_worker_holds_its_slots_refuses_past_its_queue_and_skips_the_stalled():
    async def go():
        engine = _Counting()
        w = EngineWorker(engine, "counting", slots=1)
        try:
            a = w.submit(types.SimpleNamespace(name="a", done=False))
            b = w.submit(types.SimpleNamespace(name="b", done=False))  # queued behind a
            with pytest.raises(Overloaded):
                w.submit(types.SimpleNamespace(name="c", done=False))
            w.cancel(b)  # left while queued: never reaches the engine
            outputs = a.outputs()
            await anext(outputs)
            await asyncio.sleep(0.3)  # nobody reads a: the engine stops stepping it
            steps = len(engine.stepped)
            await asyncio.sleep(0.3)
            stalled = len(engine.stepped) - steps
            w.cancel(a)
            await asyncio.sleep(0.1)
            return engine, a.backlog, stalled
        finally:
            w.stop()

    engine, backlog, stalled = asyncio.run(go())
    assert engine.added == ["a"] and engine.freed == ["a"]
    assert backlog <= OUTPUT_BOUND + 1 and stalled == 0


class _Slow:
    """Its first call is refused for load; later ones take longer than their callers wait."""

    calls = 0

    @metrics.rpc
    async def Get(self, request, context):
        self.calls += 1
        if self.calls == 1:
            raise Overloaded("busy now", 1.5)
        await asyncio.sleep(5)


def test_statuses_a_call_ends_with():
    async def go():
        server = grpc.aio.server()
        from services.runtime.server import add_service
        add_service(server, _Slow(), load_pb2.DESCRIPTOR.services_by_name["Load"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = load_pb2_grpc.LoadStub(ch)
                try:
                    await stub.Get(load_pb2.LoadRequest())
                except grpc.aio.AioRpcError as e:
                    codes["busy"] = e
                before = {c: metrics.REQUESTS.labels(metrics.STAGE, "Get", c)._value.get()
                          for c in ("DEADLINE_EXCEEDED", "CANCELLED")}
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Get(load_pb2.LoadRequest(), timeout=0.2)
                call = stub.Get(load_pb2.LoadRequest())
                await asyncio.sleep(0.2)
                call.cancel()
                await asyncio.sleep(0.3)
                after = {c: metrics.REQUESTS.labels(metrics.STAGE, "Get", c)._value.get() - before[c] for c in before}
        finally:
            await server.stop(0)
        return codes["busy"], after

    busy, counted = asyncio.run(go())
    assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and busy.details() == "busy now"
    info = error_details_pb2.RetryInfo()
    assert rpc_status.from_call(busy).details[0].Unpack(info) and info.retry_delay.ToNanoseconds() == 1_500_000_000
    assert dict(busy.trailing_metadata())["grpc-retry-pushback-ms"] == "1500"  # for clients' retry policies
    assert counted == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 1}
