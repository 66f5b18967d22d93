"""The preprocess stage's worker pool: decoders run one thread each, side by side; the stage's own process
runs one too."""

import asyncio

import grpc
import pytest
import torch

from services.preprocess.media import Preprocessor
from services.preprocess.server import PreprocessServicer, build
from services.runtime.config import Limits, load_config
from conftest import write_config


@pytest.mark.timeout(300)
def test_worker_processes_decode_on_one_thread_each(tiny_model):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    servicer = PreprocessServicer(Preprocessor(tiny_model, Limits(), 50), transport=None, workers=2)
    try:
        asyncio.run(servicer.start())
        threads = [servicer.pool.submit(torch.get_num_threads).result(timeout=120) for _ in range(4)]
        own = torch.get_num_threads()
    finally:
        servicer.pool.shutdown()
        torch.set_num_threads(before)
    assert threads == [1, 1, 1, 1]
    assert own == 2  # the server's own setting is its own


@pytest.mark.timeout(300)
def test_the_stage_process_moves_bytes_on_one_thread(tiny_model, tmp_path):
    """The stage's process only copies features into the shared pool: a copy split over a thread per core leaves
    them all spinning afterwards."""
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
