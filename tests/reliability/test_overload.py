"""Overload on a small CPU mesh of its own (the native engines, two sequences a step): offered five times what it
can serve, the mesh serves what it admits at about its unloaded latency and refuses the rest at once with
RESOURCE_EXHAUSTED and a retry hint, recovers as soon as the load stops, refuses a direct call past a stage's
bound, stops producing for a client that stops reading, and answers the HTTP door's clients 429 + Retry-After."""

import asyncio
import time

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from api.conftest import start_api, stop
from bad_requests import user
from client_util import metric
from conftest import _running_mesh, wait_until
from omni.stage.v1 import common_pb2, load_pb2, load_pb2_grpc, thinker_pb2, thinker_pb2_grpc
from omni.v1 import omni_pb2_grpc
from services.runtime.admission import queue_bound

SLOTS = 2  # the thinker's and the talker's max_seqs: what each engine holds at once
BOUND = SLOTS + queue_bound(SLOTS)  # requests a stage or the gateway takes before it refuses
TOKENS = 48  # per request: long enough that a step's jitter is small beside it
DEADLINE_S = 10.0  # every loaded request's, as the clients of a service would set it
LOAD_S = 6.0  # of five times capacity: unbounded queues would grow far past any deadline in it
HOLD = 4000  # tokens of a request that holds its slot while a test looks
FRAMES = 4096  # of speech asked by the stalled client: far more than the streams' windows hold


@pytest.fixture(scope="module")
def small(tiny_model, tmp_path_factory):
    engine = {"max_seqs": SLOTS, "block_size": 8, "max_batched_tokens": 64, "kv_blocks": 1024}  # HOLD fits
    m = _running_mesh(tmp_path_factory.mktemp("overload"), tiny_model, encoders=1, thinker=dict(engine),
                      talker=dict(engine), preprocess={"workers": 1},
                      limits={"max_new_tokens": HOLD, "max_context_tokens": HOLD + 64, "max_talker_frames": FRAMES})
    yield m
    codes = m.stop()
    assert all(c == 0 for c in codes.values()), f"stages did not stop cleanly: {codes}"


def text(tokens: int = TOKENS):
    req = user(("text", "count")).request(max_tokens=tokens)
    req.sampling.ignore_eos = True
    return req


async def timed(stub, req, timeout: float = DEADLINE_S):
    """(status, seconds, error) of one Generate read to its end."""
    t0 = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=timeout):
            pass
        return grpc.StatusCode.OK, time.perf_counter() - t0, None
    except grpc.aio.AioRpcError as e:
        return e.code(), time.perf_counter() - t0, e


def retry_delay(e: grpc.aio.AioRpcError) -> float | None:
    status = rpc_status.from_call(e)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def active(mesh, stage: str) -> int:
    with grpc.insecure_channel(mesh.cfg.replicas(stage)[0].address) as ch:
        return load_pb2_grpc.LoadStub(ch).Get(load_pb2.LoadRequest(), timeout=5).active


def idle(mesh) -> bool:
    """The thinker and the talker hold and queue nothing."""
    for stage in ("thinker", "talker"):
        with grpc.insecure_channel(mesh.cfg.replicas(stage)[0].address) as ch:
            r = load_pb2_grpc.LoadStub(ch).Get(load_pb2.LoadRequest(), timeout=5)
        if r.active or r.queued:
            return False
    return True


async def offer(stub, rate: float, seconds: float) -> tuple[list, float]:
    """Requests at `rate` a second for `seconds` (open loop: none waits for another), each read to its end; and
    when the last was sent."""
    tasks, t0, i = [], time.perf_counter(), 0
    while (now := time.perf_counter()) - t0 < seconds:
        tasks.append(asyncio.create_task(timed(stub, text())))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - now))
    last = time.perf_counter()
    return await asyncio.gather(*tasks), last


async def closed_loop(stub, clients: int, seconds: float) -> tuple[float, list[float]]:
    """Throughput (requests a second) and latencies of `clients` clients each sending its next when one ends."""
    done, end = [], time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < end:
            code, s, _ = await timed(stub, text())
            assert code == grpc.StatusCode.OK, code
            done.append(s)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(done) / (time.perf_counter() - t0), done


def test_five_times_capacity(small):
    async def go():
        async with grpc.aio.insecure_channel(small.gateway_address) as ch:
            stub = omni_pb2_grpc.OmniStub(ch)
            for _ in range(3):  # first-use costs out of the way
                await timed(stub, text())
            unloaded = [(await timed(stub, text()))[1] for _ in range(6)]
            capacity, _ = await closed_loop(stub, SLOTS, 4.0)
            results, stopped = await offer(stub, 5 * capacity, LOAD_S)
            return unloaded, capacity, results, stopped

    unloaded, capacity, results, stopped = asyncio.run(go())
    ok = [s for code, s, _ in results if code == grpc.StatusCode.OK]
    refused = [(s, e) for code, s, e in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    others = {code.name for code, _, _ in results} - {"OK", "RESOURCE_EXHAUSTED"}
    assert not others, f"neither served nor refused: {others} (a request waited out its deadline)"
    assert len(ok) >= 0.5 * capacity * LOAD_S, f"served {len(ok)} at {capacity:.1f}/s capacity"
    assert len(refused) >= len(results) / 2, f"refused {len(refused)} of {len(results)}"
    # Twice the unloaded latency, and a fixed allowance for the shared machine's other work (unbounded: seconds)
    base = pct(unloaded, 0.5)
    assert pct(ok, 0.99) <= 2 * base + 0.5, f"served p99 {pct(ok, 0.99):.2f} s, unloaded {base:.2f} s"
    assert pct([s for s, _ in refused], 0.95) < 0.1, sorted(s for s, _ in refused)[-5:]
    delays = [retry_delay(e) for _, e in refused]
    assert all(d is not None and d > 0 for d in delays), delays[:5]
    # Recovery: within 5 s of the load stopping the engines are idle and a request is served as when unloaded
    assert wait_until(lambda: idle(small), timeout=5.0 - (time.perf_counter() - stopped), every=0.1)
    again = asyncio.run(_one(small.gateway_address))
    assert again[0] == grpc.StatusCode.OK and again[1] <= 2 * base + 0.2, (again, base)


async def _one(address: str):
    async with grpc.aio.insecure_channel(address) as ch:
        return await timed(omni_pb2_grpc.OmniStub(ch), text())


def _thinker_request(i: int):
    return thinker_pb2.ThinkerRequest(request_id=f"direct{i}", prompt_ids=[1, 2, 3, 4],
                                      sampling=common_pb2.Sampling(max_tokens=HOLD, ignore_eos=True))


def test_a_direct_call_past_a_stages_bound_is_refused(small):
    """Calls to the thinker itself (no gateway in front): past its slots and queue, refused at once with a hint."""
    async def go():
        async with grpc.aio.insecure_channel(small.cfg.thinker.replicas[0].address) as ch:
            stub = thinker_pb2_grpc.ThinkerStub(ch)
            calls = [stub.Generate(_thinker_request(i), timeout=60) for i in range(BOUND + 2)]
            t0 = time.perf_counter()

            async def first(call):
                try:
                    await call.read()
                    return "started", time.perf_counter() - t0, None
                except grpc.aio.AioRpcError as e:
                    return e.code(), time.perf_counter() - t0, e

            done, waiting = await asyncio.wait([asyncio.create_task(first(c)) for c in calls], timeout=1.0)
            for c in calls:
                c.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            return [d.result() for d in done], len(waiting)

    answered, queued = asyncio.run(go())
    refused = [o for o in answered if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    started = [o for o in answered if o[0] == "started"]
    assert (len(started), queued, len(refused)) == (SLOTS, BOUND - SLOTS, 2), answered
    assert all(s < 0.5 and retry_delay(e) is not None and "capacity" in e.details() for _, s, e in refused), refused
    assert wait_until(lambda: idle(small), timeout=5.0, every=0.1)


def test_a_direct_call_past_the_preprocess_bound_is_refused(small):
    """Calls to a preprocess stage itself: what the gateway admits for the thinkers (decoding or waiting for the
    worker) and a queue behind; past them refused at once with a hint, and the admitted ones all decoded."""
    from omni.stage.v1 import preprocess_pb2, preprocess_pb2_grpc
    from omni.v1 import omni_pb2
    from references import wav
    from services.runtime.admission import stage_slots

    bound = stage_slots(small.cfg, "preprocess")
    bound += queue_bound(bound)
    clip = omni_pb2.Audio(file=wav(0, seconds=20.0))
    req = preprocess_pb2.PreprocessRequest(request_id="direct", items=[preprocess_pb2.MediaItem(audio=clip)] * 3)

    async def go():
        async with grpc.aio.insecure_channel(small.cfg.preprocess.replicas[0].address) as ch:
            stub = preprocess_pb2_grpc.PreprocessStub(ch)
            t0 = time.perf_counter()

            async def one():
                try:
                    await stub.Process(req, timeout=120)
                    return grpc.StatusCode.OK, time.perf_counter() - t0, None
                except grpc.aio.AioRpcError as e:
                    return e.code(), time.perf_counter() - t0, e

            return await asyncio.gather(*(one() for _ in range(bound + 3)))

    outcomes = asyncio.run(go())
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert [o[0] for o in outcomes].count(grpc.StatusCode.OK) == bound and len(refused) == 3, outcomes
    assert all(s < 0.5 and retry_delay(e) is not None and "preprocess is at capacity" in e.details()
               for _, s, e in refused), refused


def test_a_client_that_stops_reading_stops_the_stages(small):
    """A speech stream whose client reads its first audio and then nothing: the talker stops producing long before
    the speech asked for, and the gateway holds a few outputs, not the whole answer (the text, a few bytes a token,
    fits in the streams' windows: the thinker ends it)."""
    ports = {stage: small.cfg.replicas(stage)[0].metrics_port for stage in ("gateway", "thinker", "talker")}

    def made():
        return tuple(metric(ports[s], "omni_generated_tokens_total", stage=s) for s in ("thinker", "talker"))

    req = user(("text", "talk")).request(speech=True, max_tokens=TOKENS, frames=FRAMES)
    req.sampling.ignore_eos = req.talker_sampling.ignore_eos = True
    before = made()
    # The client's receive window stays small: what fills is the gateway's and the stages' own
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    with grpc.insecure_channel(small.gateway_address, options=options) as ch:
        call = omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=120)
        for resp in call:
            if resp.HasField("audio"):
                break
        rss = metric(ports["gateway"], "process_resident_memory_bytes")
        last = [made(), time.monotonic()]

        def settled():  # nothing made for 2 s
            now = made()
            if now != last[0]:
                last[:] = [now, time.monotonic()]
            return time.monotonic() - last[1] > 2.0

        assert wait_until(settled, timeout=40.0, every=0.2), f"the stages kept producing: {made()}"
        frames = made()[1] - before[1]
        grown = metric(ports["gateway"], "process_resident_memory_bytes") - rss
        call.cancel()
    assert frames < FRAMES / 2, f"{frames} frames made for a client that read one chunk"
    assert grown < 32 << 20, f"the gateway grew {grown / 2**20:.0f} MiB"
    assert wait_until(lambda: idle(small), timeout=5.0, every=0.1)


def test_overload_through_the_http_door_is_429_with_retry_after(small, tmp_path_factory):
    door = start_api(small.config_path, tmp_path_factory.mktemp("door"), "api-overload")
    try:
        async def go():
            async with grpc.aio.insecure_channel(small.gateway_address) as ch:
                stub = omni_pb2_grpc.OmniStub(ch)
                calls = [stub.Generate(text(HOLD), timeout=60) for _ in range(BOUND)]
                # Waited for by the stages' counts, not a first text delta: a random model's tokens may print nothing
                port = small.cfg.gateway.replicas[0].metrics_port
                assert await asyncio.to_thread(wait_until, lambda: active(small, "thinker") >= SLOTS and metric(
                    port, "omni_inflight_requests", method="Generate") >= BOUND, 10.0, 0.05)
                async with httpx.AsyncClient(timeout=30) as http:
                    r = await http.post(door.url + "/v1/chat/completions", json={
                        "model": small.cfg.model.name, "messages": [{"role": "user", "content": "hi"}]})
                for c in calls:
                    c.cancel()
                return r

        r = asyncio.run(go())
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        stop(door)
    assert wait_until(lambda: idle(small), timeout=5.0, every=0.1)
