"""The preprocess stage's worker pool: decoders run one thread each, side by side."""

import asyncio

import pytest
import torch

from services.preprocess.media import Preprocessor
from services.preprocess.server import PreprocessServicer
from services.runtime.config import Limits


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
