"""CUDA IPC transport between real processes: a producer on GPU0, consumers on GPU0 and GPU1."""

import contextlib
import dataclasses
import multiprocessing as mp
import time

import pytest
import torch

from omni.stage.v1 import tensor_pb2
from services.runtime.config import TransportConfig

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16, torch.uint8]
SHAPES = [(1,), (7,), (3, 5), (256, 2048), (2, 3, 4), (1000, 33)]
CFG = TransportConfig(cuda_pool_bytes=256 << 20)
IN_FLIGHT = 64  # refs a test producer has out at once (of 256 MB)
QUICK_RECLAIM = TransportConfig(cuda_pool_bytes=64 << 20)
QUICK_RECLAIM_S = 3.0


_BASE: dict = {}


def tensor(i: int, device) -> torch.Tensor:
    """The i-th test tensor: one of a few random bases (all dtypes and shapes), stamped with i."""
    k = i % (len(DTYPES) * len(SHAPES))
    if (k, str(device)) not in _BASE:
        dtype, shape = DTYPES[k % len(DTYPES)], SHAPES[k // len(DTYPES)]
        g = torch.Generator(device="cpu").manual_seed(k)
        _BASE[k, str(device)] = (torch.randn(shape, generator=g) * 1000).to(dtype).to(device)
    t = _BASE[k, str(device)].clone()
    t.view(-1)[0] = i % 101
    return t


def producer(device: str, n: int, outs, report, name: str, go, cfg=CFG) -> None:
    from services.runtime import transport

    transport.INLINE_BYTES = 0  # host tensors of every size through shared memory
    t = transport.Transport(cfg, name)
    go.wait()  # every consumer is up: none starts late enough to find its slots reclaimed
    cuda = device.startswith("cuda")
    placement = tensor_pb2.Placement(shm_domain="local", cuda=cuda)
    pool = t.cuda_pool(torch.device(device)).table if cuda else t.pool
    for i in range(n):
        while pool.slots_in_use >= IN_FLIGHT:  # as a stage would, with its requests in flight: the pool never fills
            pool.sweep()
            time.sleep(0.0005)
        ref = t.put(tensor(i, device), placement)
        assert ref.WhichOneof("location") == ("cuda" if cuda else "shm")
        outs[i % len(outs)].send((i, ref.SerializeToString()))
    for q in outs:
        q.send(None)
    deadline = time.monotonic() + 30  # wait until every consumer has released what it read
    while pool.slots_in_use and time.monotonic() < deadline:
        time.sleep(0.05)
    report.send(("producer", name, pool.slots_in_use))
    time.sleep(1)  # consumers may still hold the mapping while they exit
    t.close()


def consumer(device: str, inbox, report, name: str, cfg=CFG) -> None:
    from services.runtime.transport import Transport

    t = Transport(cfg, name)
    torch.zeros(1, device=device)
    report.send("ready")
    count = bad = 0
    while (item := inbox.recv()) is not None:
        i, data = item
        got = t.get(tensor_pb2.TensorRef.FromString(data), device)
        bad += not (got.device.type == torch.device(device).type and torch.equal(got.cpu(), tensor(i, "cpu")))
        count += 1
    report.send(("consumer", name, count, bad))


def run(producers: list[tuple[str, int]], consumers_per_producer: list[str], cfg=CFG) -> list:
    """Producers send refs through pipes to their consumers; every process reports through its own pipe."""
    ctx = mp.get_context("spawn")
    procs, reports, consumer_reports = [], [], []
    go = ctx.Event()

    def report_pipe():
        r, w = ctx.Pipe(duplex=False)
        reports.append(r)
        return w

    for p, (pdev, n) in enumerate(producers):
        pipes = [ctx.Pipe(duplex=False) for _ in consumers_per_producer]
        procs.append(ctx.Process(target=producer, args=(pdev, n, [w for _, w in pipes], report_pipe(), f"prod{p}", go, cfg)))
        for c, (cdev, (r, _)) in enumerate(zip(consumers_per_producer, pipes)):
            procs.append(ctx.Process(target=consumer, args=(cdev, r, report_pipe(), f"cons{p}{c}", cfg)))
            consumer_reports.append(reports[-1])
    for proc in procs:
        proc.start()
    for r in consumer_reports:
        assert r.poll(300) and r.recv() == "ready"
    go.set()
    results = []
    for r in reports:
        assert r.poll(300), "a process did not report"
        results.append(r.recv())
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return results


def devices() -> list[str]:
    return ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]


def test_bit_exact_to_the_same_gpu_and_across_gpus():
    n = len(DTYPES) * len(SHAPES) * 2
    results = run([("cuda:0", n)], devices())
    consumers = [r for r in results if r[0] == "consumer"]
    assert sum(r[2] for r in consumers) == n and all(r[3] == 0 for r in consumers), results
    assert [r[2] for r in results if r[0] == "producer"] == [0]


def test_ten_thousand_transfers_leave_the_pool_empty():
    results = run([("cuda:0", 10_000)], devices())
    assert sum(r[2] for r in results if r[0] == "consumer") == 10_000
    assert all(r[3] == 0 for r in results if r[0] == "consumer")
    assert [r[2] for r in results if r[0] == "producer"] == [0]


def test_concurrent_producers_and_consumers():
    results = run([("cuda:0", 2000), (devices()[1], 2000)], devices())
    assert sum(r[2] for r in results if r[0] == "consumer") == 4000
    assert all(r[3] == 0 for r in results if r[0] == "consumer")
    assert [r[2] for r in results if r[0] == "producer"] == [0, 0]


def _map_and_die(data: bytes, ready) -> None:
    from services.runtime.transport import Transport

    t = Transport(QUICK_RECLAIM, "dying", reclaim_after_s=QUICK_RECLAIM_S)
    ref = tensor_pb2.TensorRef.FromString(data)
    t._mapped_pool(ref.cuda)  # maps the pool, never reads or releases the slot
    ready.set()
    time.sleep(60)


def test_a_killed_consumers_slots_are_reclaimed():
    from services.runtime.transport import Transport

    t = Transport(QUICK_RECLAIM, "killprod", reclaim_after_s=QUICK_RECLAIM_S)
    placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
    refs = [t.put(tensor(i, "cuda:0"), placement) for i in range(20)]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_map_and_die, args=(refs[0].SerializeToString(), ready))
    proc.start()
    assert ready.wait(120)
    proc.kill()
    proc.join()
    pool = t.cuda_pool(torch.device("cuda:0"))
    deadline = time.monotonic() + QUICK_RECLAIM_S + 5
    while pool.table.slots_in_use and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.table.slots_in_use == 0
    assert t.put(tensor(0, "cuda:0"), placement).WhichOneof("location") == "cuda"  # and the pool still serves
    t.close()


def _busy(device: str) -> None:
    """Keeps `device`'s current stream busy for a few hundred ms (a kernel spinning 6e8 cycles: 0.3 s at the
    H200's 2 GHz), without the host waiting."""
    with torch.cuda.device(device):
        torch.cuda._sleep(600_000_000)


def _read_while_busy(first: bytes, second: bytes, device: str, expected, report) -> None:
    from services.runtime.transport import Transport

    t = Transport(CFG, "busyread")
    torch.zeros(1, device=device)
    t.get(tensor_pb2.TensorRef.FromString(first), device)  # maps the pool (opening a handle may wait for the device)
    with torch.cuda.device(device):
        _busy(device)
        got = t.get(tensor_pb2.TensorRef.FromString(second), device)
        still_busy = not torch.cuda.current_stream().query()
    report.send((still_busy, torch.equal(got.cpu(), expected)))


def test_puts_and_gets_wait_for_their_own_copies_not_for_the_stages_other_work():
    """A stage's engine keeps its stream busy: a put given its tensor's `ready` event, and a get, return while
    that work still runs (their copies run on the transport's own streams), with the bytes exact."""
    from services.runtime.transport import Transport

    t = Transport(CFG, "busyput")
    try:
        placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
        x = tensor(3, "cuda:0")
        t.cuda_pool(torch.device("cuda:0"))  # the pool exists before the stream is kept busy
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.device("cuda:0"):
            _busy("cuda:0")
            t0 = time.perf_counter()
            ref = t.put(x, placement, ready)
            took = time.perf_counter() - t0
            assert not torch.cuda.current_stream().query(), f"the put waited for work queued after its tensor ({took * 1000:.0f} ms)"
            torch.cuda.synchronize()
        pool = t.cuda_pool(torch.device("cuda:0"))
        s = ref.cuda
        assert torch.equal(pool.buffer[s.offset:s.offset + s.nbytes], x.reshape(-1).view(torch.uint8))
        ctx = mp.get_context("spawn")
        for device in devices():
            r, w = ctx.Pipe(duplex=False)
            refs = [t.put(x, placement).SerializeToString() for _ in range(2)]
            proc = ctx.Process(target=_read_while_busy, args=(*refs, device, x.cpu(), w))
            proc.start()
            assert r.poll(120)
            still_busy, exact = r.recv()
            proc.join(timeout=60)
            assert exact and still_busy, (device, still_busy, exact)
    finally:
        t.close()  # its pool's name (pid-stamped) is free for the next test


def test_host_refs_read_to_a_busy_gpu_wait_for_their_own_copy():
    """A ref to host memory (a shared-memory slot, or bytes in the message) read to a GPU whose stream the stage's
    engine keeps busy (the encoder's, taking in pixels): the get returns while that work still runs, and the bytes
    are exact. From pageable memory on the caller's stream, the copy waited for all of it first."""
    from services.runtime.transport import Transport

    shm, inline = Transport(CFG, "busyhost"), Transport(dataclasses.replace(CFG, shm=False), "busyinline")
    try:
        placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
        x = tensor(3 * len(DTYPES), "cpu")  # float32 (256, 2048): 2 MB, past what goes inline for being small
        for t, where in ((shm, "shm"), (inline, "inline_data")):
            t.get(t.put(x, placement), "cuda:0")  # pinned memory allocated once, before the stream is kept busy
            ref = t.put(x, placement)
            assert ref.WhichOneof("location") == where
            with torch.cuda.device("cuda:0"):
                _busy("cuda:0")
                got = t.get(ref, "cuda:0")
                still_busy = not torch.cuda.current_stream().query()
                torch.cuda.synchronize()
            assert still_busy, f"the get of a {where} ref waited for the stream's other work"
            assert got.device == torch.device("cuda:0") and torch.equal(got.cpu(), x), where
    finally:
        shm.close()
        inline.close()


def _put_stacks(refs_out) -> None:
    from services.runtime.transport import Transport

    t = Transport(CFG, "stackprod")
    placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
    x = torch.stack([tensor(3, "cuda:0")] * 4)  # non-contiguous parts below: every other row
    refs_out.send([t.put([x[0], x[1] * 2], placement).SerializeToString(), t.put([x[::2], x[1::2]], placement).SerializeToString()])
    refs_out.recv()  # the consumer has read them
    t.close()


@contextlib.contextmanager
def refs_from(producer):
    """Runs `producer(pipe)` in a process of its own; yields what it sends (its refs), tells it they were read."""
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(theirs,))
    proc.start()
    try:
        assert mine.poll(120)
        yield mine.recv()
        mine.send(None)
    finally:
        proc.join(timeout=60)


def test_tensors_put_together_cross_gpus_as_their_stack():
    """put([a, b]) of CUDA tensors: one CUDA IPC slot, each part copied into it (non-contiguous parts too);
    the consumer on the other GPU reads their stack."""
    from services.runtime.transport import Transport

    with refs_from(_put_stacks) as refs:
        first, second = (tensor_pb2.TensorRef.FromString(r) for r in refs)
        t = Transport(CFG, "stackcons")
        x = torch.stack([tensor(3, "cpu")] * 4)
        for ref, want in ((first, torch.stack([x[0], x[1] * 2])), (second, torch.stack([x[::2], x[1::2]]))):
            assert ref.WhichOneof("location") == "cuda"
            assert torch.equal(t.get(ref, devices()[1]).cpu(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_mark_on_the_second_gpu_waits_for_its_work_whatever_the_threads_gpu():
    """A talker on GPU1 reads its codes once its `mark` is reached: the mark must follow GPU1's work even where
    the thread's current GPU is GPU0 (it did not: the mesh's talker read codes the device had not written)."""
    from services.llm.host import mark, reached, wait_for

    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        torch.cuda._sleep(2_000_000_000)  # about a second of one GPU1 thread spinning
    m = mark(torch.device("cuda:1"))
    assert not reached(m)
    wait_for(m)
    assert reached(m)
