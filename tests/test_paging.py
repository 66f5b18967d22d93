"""The host-side paging that the flashinfer backends hand to their kernels (CPU: no kernel runs here), and
the ladder of captured batch sizes."""

import torch

from services.llm.attention import SeqSlice, TorchAttention
from services.llm.flashinfer_attention import _page_table, _slots
from services.llm.graphs import ladder
from services.llm.kv_cache import KVCache


def test_slots_and_page_table_agree_with_the_reference_backend():
    cache = KVCache.allocate(1, 32, 4, 1, 8, torch.float32, "cpu")
    slices = [SeqSlice([7, 3, 9], 0, 10), SeqSlice([1, 30, 2, 5], 9, 1), SeqSlice([12], 2, 2), SeqSlice([4, 6], 4, 4)]
    ref = TorchAttention(cache, 1.0).plan(slices).slot_mapping.tolist()
    assert _slots(slices, 4) == ref
    indptr, indices, last = _page_table(slices, 4)
    assert indptr == [0, 3, 6, 7, 9]
    assert indices == [7, 3, 9, 1, 30, 2, 12, 4, 6]
    assert last == [2, 2, 4, 4]  # keys held in each sequence's last page, this step's included


def test_ladder_covers_every_batch_up_to_its_maximum():
    assert ladder(1) == [1]
    assert ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = ladder(200)
    assert sizes[-1] == 200 and sizes == sorted(set(sizes))
    assert all(b - a <= 32 for a, b in zip(sizes, sizes[1:]))
