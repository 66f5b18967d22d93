"""The preprocess stage's worker pool: decoders run one thread each, side by side; the stage's own process
runs one too."""

import asyncio
import os

import grpc
import pytest
import torch

from services.preprocess.media import Preprocessor
from services.preprocess.server import PreprocessServicer, build
from services.runtime.config import Limits, load_config
from conftest import write_config


@pytest.mark.timeout(300)
def test_worker_processes_decode_on_one_thread_each(tiny_model):
    torch.set_num_threads(2)
    servicer = PreprocessServicer(Preprocessor(tiny_model, Limits(), 50), transport=None, workers=2)
    try:
        asyncio.run(servicer.start())
        threads = [servicer.pool.submit(torch.get_num_threads).result(timeout=120) for _ in range(4)]
    finally:
        servicer.pool.shutdown()
    assert threads == [1, 1, 1, 1]
    assert torch.get_num_threads() == 2  # the server's own setting is its own


@pytest.mark.timeout(300)
def test_the_stage_process_moves_bytes_on_one_thread(tiny_model, tmp_path):
    """The stage's process only copies features into the shared pool: a copy split over a thread per core leaves
    them all spinning afterwards (services.preprocess.server.build says what that cost)."""
    cfg = load_config(write_config(tmp_path / "mesh.yaml", tiny_model))

    async def built_threads() -> int:
        stage = await build(cfg, 0, grpc.aio.server())
        try:
            return torch.get_num_threads()
        finally:
            await stage.close()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert asyncio.run(built_threads()) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(300)
def test_workers_put_features_into_pools_of_their_own(tiny_model):
    """preprocess.put_in_workers: a worker process puts the features it made into a shared-memory pool of its
    own and hands back their ref, not their values; a consumer reads the features prepared in process; the
    replica counts the transfer; without a placement the values come back as before; the pool goes with the
    worker."""
    from pathlib import Path

    from omni.stage.v1 import preprocess_pb2, tensor_pb2
    from omni.v1 import omni_pb2
    from references import png
    from services.preprocess.server import prepare
    from services.runtime import metrics
    from services.runtime.config import TransportConfig
    from services.runtime.transport import Transport

    pre = Preprocessor(tiny_model, Limits(), 50)
    item = preprocess_pb2.MediaItem(image=omni_pb2.Image(data=png(7, 96, 64)))
    want = torch.from_numpy(prepare(pre, 0, item).values)
    main, consumer = Transport(TransportConfig(), "pretest", "local"), Transport(TransportConfig(), "contest", "local")
    servicer = PreprocessServicer(pre, main, workers=1, put_in_workers=True)
    counted = metrics.TRANSPORT_TRANSFERS.labels("shm", "out")
    before = counted._value.get()

    async def run(placement):
        await servicer.start()
        return await servicer._run(0, item, placement)

    try:
        f, ref = asyncio.run(run(tensor_pb2.Placement(shm_domain="local")))
        assert f.values is None and ref.WhichOneof("location") == "shm"
        pool = Path("/dev/shm") / ref.shm.pool
        assert pool.exists() and ref.shm.pool.startswith("omni-pretestw-") and not ref.shm.pool.endswith(f"-{os.getpid()}")
        main.count_out(ref)
        assert counted._value.get() == before + 1
        assert torch.equal(consumer.get(ref), want)
        f, ref = asyncio.run(run(None))  # no placement: the values come back, for the replica to put
        assert ref is None and torch.equal(torch.from_numpy(f.values), want)
    finally:
        servicer.pool.shutdown(wait=True)
        main.close()
        consumer.close()
    assert not pool.exists()  # the worker closed its pool as it exited
