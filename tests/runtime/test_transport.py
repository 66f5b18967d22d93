"""Tensor transport: shared memory between processes of one host, inline bytes otherwise."""

import multiprocessing as mp
import time

import pytest
import torch

from conftest import wait_until
from omni.stage.v1 import tensor_pb2
from services.runtime import metrics
from services.runtime.config import TransportConfig
from services.runtime.errors import InvalidArgument
from services.runtime import shm, transport
from services.runtime.transport import Transport

HERE = tensor_pb2.Placement(shm_domain="local")
ELSEWHERE = tensor_pb2.Placement(shm_domain="other-host")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16, torch.uint8]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4)]


def make(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


@pytest.fixture
def no_inline(monkeypatch):
    """Every size through shared memory: nothing inline for being small."""
    monkeypatch.setattr(transport, "INLINE_BYTES", 0)


class Clock:
    """transport's time, stood in: monotonic() moves only when a test moves it; sleep() is time's own (the pools'
    sweepers still sweep every period, at this clock's time)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    sleep = staticmethod(time.sleep)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(shm, "time", c)
    return c


@pytest.fixture
def pair(no_inline, monkeypatch):
    monkeypatch.setattr(shm, "MAX_SLOTS", 64)
    cfg = TransportConfig(pool_bytes=1 << 20)
    producer, consumer = Transport(cfg, "testprod", reclaim_after_s=1.0), Transport(cfg, "testcons", reclaim_after_s=1.0)
    yield producer, consumer
    producer.close()


@pytest.mark.parametrize("placement", [HERE, ELSEWHERE], ids=["shm", "inline"])
def test_round_trip_is_bit_exact(pair, placement):
    producer, consumer = pair
    for i, dtype in enumerate(DTYPES):
        for shape in SHAPES:
            t = make(dtype, shape, i)
            ref = producer.put(t, placement)
            assert ref.WhichOneof("location") == ("shm" if placement is HERE and t.numel() else "inline_data")
            back = consumer.get(ref)
            assert back.dtype == dtype and tuple(back.shape) == shape and torch.equal(back, t)
    producer.pool.sweep() if placement is HERE else None
    assert placement is not HERE or producer.pool.slots_in_use == 0


def test_bytes_and_transfers_are_counted_by_transport_and_direction(pair):
    producer, consumer = pair
    value = lambda metric, *labels: metric.labels(*labels)._value.get()  # noqa: E731
    keys = [(m, t, d) for m in (metrics.TRANSPORT_BYTES, metrics.TRANSPORT_TRANSFERS) for t in ("shm", "inline") for d in ("out", "in")]
    before = {k: value(*k) for k in keys}
    for placement in (HERE, HERE, ELSEWHERE):
        consumer.get(producer.put(make(torch.float32, (100,)), placement))
    moved = {(m.describe()[0].name, t, d): value(m, t, d) - before[m, t, d] for m, t, d in keys}
    assert moved == {("omni_transport_bytes", "shm", "out"): 800, ("omni_transport_bytes", "shm", "in"): 800,
                     ("omni_transport_bytes", "inline", "out"): 400, ("omni_transport_bytes", "inline", "in"): 400,
                     ("omni_transport_transfers", "shm", "out"): 2, ("omni_transport_transfers", "shm", "in"): 2,
                     ("omni_transport_transfers", "inline", "out"): 1, ("omni_transport_transfers", "inline", "in"): 1}


def test_unreleased_slots_are_reclaimed(pair, clock):
    """Slots nobody released are reclaimed once held longer than reclaim_after_s (1 s here), not before."""
    producer, consumer = pair
    before = metrics.SHM_RECLAIMED.labels("shm")._value.get()
    refs = [producer.put(make(torch.float32, (100,), i), HERE) for i in range(5)]
    assert producer.pool.slots_in_use == 5
    consumer.get(refs[0])  # released by its reader
    producer.pool.sweep()
    assert producer.pool.slots_in_use == 4
    clock.now += 0.99  # held just under reclaim_after_s: kept
    producer.pool.sweep()
    assert producer.pool.slots_in_use == 4 and metrics.SHM_RECLAIMED.labels("shm")._value.get() == before
    clock.now += 0.02
    producer.pool.sweep()
    assert producer.pool.slots_in_use == 0 and metrics.SHM_RECLAIMED.labels("shm")._value.get() - before == 4
    with pytest.raises(ValueError, match="released or reclaimed before it was read"):
        consumer.get(refs[1])


def _die_holding(ref_bytes: bytes, ready) -> None:
    from services.runtime.config import TransportConfig as C
    from services.runtime.transport import Transport as T

    ref = tensor_pb2.TensorRef.FromString(ref_bytes)
    view = T(C(), "dying")._view(ref.shm.pool)  # maps the pool, never reads or releases the slot
    assert view is not None
    ready.set()
    time.sleep(60)  # until killed


def test_a_killed_consumer_leaves_no_slot_held(no_inline, clock):
    """A consumer process maps the pool and is killed before it reads: the producer's own sweeper thread (nobody
    calls sweep()) keeps the slot while the clock stays under reclaim_after_s, however often it sweeps meanwhile,
    and reclaims it once past."""
    reclaim = 0.2  # the sweeper's period: reclaim / 4, at least 50 ms
    producer = Transport(TransportConfig(pool_bytes=1 << 20), "killtest", reclaim_after_s=reclaim)
    try:
        ref = producer.put(make(torch.float32, (1000,)), HERE)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_die_holding, args=(ref.SerializeToString(), ready))
        proc.start()
        assert ready.wait(30)
        proc.kill()
        proc.join()
        assert producer.pool.slots_in_use == 1  # seconds of sweeps at a clock that has not moved
        clock.now += reclaim + 0.01
        assert wait_until(lambda: producer.pool.slots_in_use == 0, timeout=5)
    finally:
        producer.close()


def test_a_full_pool_falls_back_to_inline_without_corruption(no_inline, monkeypatch):
    monkeypatch.setattr(shm, "MAX_SLOTS", 4)
    cfg = TransportConfig(pool_bytes=4096)
    producer, consumer = Transport(cfg, "small"), Transport(cfg, "smallc")
    try:
        before = metrics.SHM_FALLBACKS.labels("shm")._value.get()
        tensors = [make(torch.float32, (300,), i) for i in range(8)]  # 1200 bytes each: 3 fit, then the slots run out
        refs = [producer.put(t, HERE) for t in tensors]
        kinds = [r.WhichOneof("location") for r in refs]
        assert kinds.count("shm") == 3 and kinds.count("inline_data") == 5
        assert metrics.SHM_FALLBACKS.labels("shm")._value.get() - before == 5
        assert all(torch.equal(consumer.get(r), t) for r, t in zip(refs, tensors))
        producer.pool.sweep()
        assert producer.pool.slots_in_use == 0
        assert producer.put(tensors[0], HERE).WhichOneof("location") == "shm"  # space is back once released
    finally:
        producer.close()


def test_shm_off_or_unknown_domain_goes_inline(no_inline):
    off = Transport(TransportConfig(shm=False), "off")
    assert off.put(torch.ones(3), HERE).WhichOneof("location") == "inline_data"
    on = Transport(TransportConfig(), "on")
    assert on.put(torch.ones(3), tensor_pb2.Placement()).WhichOneof("location") == "inline_data"


def test_small_host_tensors_go_inside_the_message():
    """Host tensors of at most INLINE_BYTES go inline even where shared memory reaches (a speech request's states
    for one token: [2, 1, 2048] bf16, 8 KB); larger ones take a slot."""
    producer, consumer = Transport(TransportConfig(), "small-in"), Transport(TransportConfig(), "small-c")
    try:
        n = transport.INLINE_BYTES // 4
        small, large = make(torch.float32, (n,), 1), make(torch.float32, (n + 1,), 2)
        refs = [producer.put(small, HERE), producer.put(large, HERE)]
        assert [r.WhichOneof("location") for r in refs] == ["inline_data", "shm"]
        assert torch.equal(consumer.get(refs[0]), small) and torch.equal(consumer.get(refs[1]), large)
        state = [make(torch.bfloat16, (1, 2048), 3), make(torch.bfloat16, (1, 2048), 4)]
        assert producer.put(state, HERE).WhichOneof("location") == "inline_data"
    finally:
        producer.close()


def test_malformed_refs_are_refused(pair):
    _, consumer = pair
    with pytest.raises(ValueError, match="inline data has 3 bytes"):
        consumer.get(tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], inline_data=b"abc"))
    with pytest.raises(InvalidArgument, match="not a tensor pool"):
        consumer.get(tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1], shm=tensor_pb2.ShmSlot(pool="../etc/passwd", nbytes=4)))
    with pytest.raises(InvalidArgument, match="does not exist"):
        consumer.get(tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1], shm=tensor_pb2.ShmSlot(pool="omni-x-1", nbytes=4)))
    with pytest.raises(ValueError, match="slot has 8 bytes"):
        consumer.get(tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1], shm=tensor_pb2.ShmSlot(pool="omni-x-1", nbytes=8)))
    with pytest.raises(ValueError, match="unknown dtype"):
        consumer.get(tensor_pb2.TensorRef(dtype=99, shape=[1], inline_data=b"abcd"))


def test_many_transfers_between_processes_leave_the_pool_empty():
    """The GPU test's harness on host memory: two producers, two consumers each."""
    from test_gpu_transport import run

    results = run([("cpu", 1000), ("cpu", 1000)], ["cpu", "cpu"])
    consumers = [r for r in results if r[0] == "consumer"]
    assert sum(r[2] for r in consumers) == 2000 and all(r[3] == 0 for r in consumers), results
    assert [r[2] for r in results if r[0] == "producer"] == [0, 0]


def test_a_put_that_finds_no_room_frees_what_consumers_released_first(no_inline, monkeypatch):
    """Puts sweep their pool at most every SWEEP_EVERY_S; one that finds no room sweeps at once, so a slot a
    consumer just released serves it, and the gauges follow the pool."""
    monkeypatch.setattr(shm, "MAX_SLOTS", 4)
    cfg = TransportConfig(pool_bytes=4096)
    producer, consumer = Transport(cfg, "roomy"), Transport(cfg, "roomyc")
    try:
        tensors = [make(torch.float32, (300,), i) for i in range(4)]
        refs = [producer.put(t, HERE) for t in tensors[:3]]  # 1200 bytes each: the pool holds three
        assert [r.WhichOneof("location") for r in refs] == ["shm"] * 3
        assert metrics.SHM_SLOTS.labels("shm")._value.get() == 3
        assert torch.equal(consumer.get(refs[1]), tensors[1])  # released: freed at the next sweep
        ref = producer.put(tensors[3], HERE)  # within the sweep interval, yet no inline fallback
        assert ref.WhichOneof("location") == "shm" and torch.equal(consumer.get(ref), tensors[3])
        assert producer.pool.slots_in_use == 3  # refs[0], refs[2], and the new one's until its next sweep
        producer.pool.sweep()
        assert producer.pool.slots_in_use == 2 and metrics.SHM_SLOTS.labels("shm")._value.get() == 2
    finally:
        producer.close()


@pytest.mark.parametrize("placement", [HERE, ELSEWHERE], ids=["shm", "inline"])
def test_tensors_put_together_come_back_as_their_stack(pair, placement):
    """put([a, b]): one ref of shape [2, *shape] (the thinker's embeds and hidden states, one slot for both);
    parts that differ in shape or dtype, or none, are refused."""
    producer, consumer = pair
    a, b = make(torch.bfloat16, (3, 16), 1), make(torch.bfloat16, (3, 16), 2)
    ref = producer.put([a, b], placement)
    assert list(ref.shape) == [2, 3, 16] and ref.WhichOneof("location") == ("shm" if placement is HERE else "inline_data")
    assert torch.equal(consumer.get(ref), torch.stack([a, b]))
    for bad in ([a, b[:2]], [a, b.float()], []):
        with pytest.raises(ValueError, match="same shape, dtype and device"):
            producer.put(bad, placement)
