"""The talker's captured frame step, host side, on the CPU: its decode graphs' inputs (rows, positions, the first
codes' draw settings) and attention plans, and the code predictor's frame graphs' settings, with flashinfer and CUDA
graphs stood in as in tests/test_decode_host.py (the real ones: tests/test_gpu_talker.py, marked gpu). With any
of what the host puts in the buffers the graphs read wrong, the codes leave transformers' greedy ones."""

import pytest

from references import native_talker
from stand_ins import eager_graphs, stand_in_flashinfer
from test_talker_engine import CHUNKS, FRAMES, cases, speak  # noqa: F401 (fixture)

from services.llm.graphs import ladder
from services.talker.decode import FrameGraphs
from services.talker.engine import NativeTalker


def captured(tiny_model, monkeypatch, max_batch: int, direct: bool = True, **engine_args) -> NativeTalker:
    """A native talker on the CPU whose decode steps and predictor frames replay "graphs" up to `max_batch`."""
    stand_in_flashinfer(monkeypatch, direct)
    eager_graphs(monkeypatch)
    engine = native_talker(tiny_model, chunks=CHUNKS, **engine_args)
    engine.predictor.capture(ladder(max_batch))
    engine.decode = FrameGraphs(engine, max_batch)
    engine.decode.graphs.graphs.attention = engine.decode.graphs.attention
    return engine


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_captured_frame_steps_give_transformers_codes(tiny_model, cases, monkeypatch, direct, overlap):
    """Four requests at once, every thinker state given: their frame steps in decode graphs of 4 rows (padded once
    requests end; a step of the last one's requests advances its page table), first codes drawn inside the graph,
    the predictor's frames in its graphs; planned directly (every plan run: the talker keeps none) or through
    flashinfer's wrapper (another flashinfer)."""
    data, spec = cases
    engine = captured(tiny_model, monkeypatch, 4, direct, overlap=overlap, block_size=4, step_graphs=0)
    seqs, _ = speak(engine, data, spec, list(data))
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"] and seq.frames, name
    replays = engine.decode.replays
    assert replays >= FRAMES - 1 and engine.predictor.graphs.replays >= FRAMES
    assert engine.graph_draws > 0
    attention = engine.decode.graphs.attention
    assert sum(a.advanced for a in attention.values()) >= FRAMES // 2  # steady plans
    wrappers = [a.wrapper for a in attention.values()]
    skipped = sum(a.kept.kept for a in attention.values() if a.kept is not None)
    # every replay's plan direct, and the capture's second (both staging buffers filled)
    assert skipped == 0 and sum(w.direct_plans for w in wrappers) == (replays + len(wrappers) if direct else 0)
    if direct:
        assert all(w.wrapper_plans == 1 for w in wrappers)
    assert engine.scheduler.allocator.used == 0 and not engine.states


def test_captured_frame_steps_of_preempted_requests_give_transformers_codes(tiny_model, cases, monkeypatch):
    """A cache of 20 blocks of 4 tokens, too few for all four requests: some are preempted and recomputed between
    frame steps, each resumed step's plan rebuilt."""
    data, spec = cases
    engine = captured(tiny_model, monkeypatch, 4, kv_blocks=20, block_size=4, max_batched_tokens=8, step_graphs=0)
    seqs, _ = speak(engine, data, spec, list(data))
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"] and seq.frames, name
    assert engine.scheduler.preemptions > 0 and engine.decode.replays >= FRAMES - 1
    assert engine.scheduler.allocator.used == 0 and not engine.states


@pytest.mark.parametrize("overlap", [False, True])
def test_captured_frame_steps_repeat_on_one_engine(tiny_model, cases, monkeypatch, overlap):
    """The same four requests three times on one engine: every run gives transformers' codes, so nothing a run
    leaves in the graphs' buffers, plans or the cache reaches the next."""
    data, spec = cases
    engine = captured(tiny_model, monkeypatch, 4, overlap=overlap, block_size=4, step_graphs=0)
    for run in range(3):
        seqs, _ = speak(engine, data, spec, list(data))
        assert [n for n, s in seqs.items() if s.frames != data[n]["codes"]] == [], run
