"""The talker's captured frame step, host side, on the CPU: its decode graphs' inputs (rows, positions, the first
codes' draw settings) and attention plans, and the code predictor's frame graphs' settings, with flashinfer and CUDA
graphs stood in as in tests/test_decode_host.py (the real ones: tests/test_gpu_talker.py, marked gpu). With any
of what the host puts in the buffers the graphs read wrong, the codes leave transformers' greedy ones."""

import pytest

from stand_ins import EagerGraphs, stand_in_flashinfer
from test_talker_engine import FRAMES, cases, speak  # noqa: F401 (fixture)

from services.llm import graphs
from services.llm.graphs import ladder
from services.model.load import load_config
from services.talker.decode import FrameGraphs
from services.talker.engine import NativeTalker


def captured(tiny_model, monkeypatch, max_batch: int, **engine_args) -> NativeTalker:
    """A native talker on the CPU whose decode steps and predictor frames replay "graphs" up to `max_batch`."""
    stand_in_flashinfer(monkeypatch)
    monkeypatch.setattr(graphs, "CapturedGraphs", EagerGraphs)
    engine = NativeTalker(tiny_model, first_chunk_frames=4, chunk_frames=8, **engine_args)
    sizes = ladder(max_batch)
    engine.predictor.capture(sizes)
    engine.workspace = None
    engine.decode = FrameGraphs(engine, sizes, engine.scheduler.allocator.num_blocks,
                                load_config(tiny_model).talker_config.text_config, engine.draws_captured)
    engine.decode.graphs.attention = engine.decode.attention
    return engine


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("graph_sampling", [False, True])
def test_captured_frame_steps_give_transformers_codes(tiny_model, cases, monkeypatch, direct, overlap, graph_sampling):
    """Four requests at once, every thinker state given: their frame steps in decode graphs of 4 rows (padded once
    requests end; a step of the last one's requests advances its page table), first codes drawn inside the graph
    or after it, the predictor's frames in its graphs."""
    data, spec = cases
    engine = captured(tiny_model, monkeypatch, 4, overlap=overlap, decode_direct_plan=direct, block_size=4,
                      graph_sampling=graph_sampling)
    seqs, _ = speak(engine, data, spec, list(data))
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"] and seq.frames, name
    assert engine.decode.graphs.replays >= FRAMES - 1 and engine.predictor.graphs.replays >= FRAMES
    assert (engine.graph_draws > 0) == graph_sampling
    assert sum(a.advanced for a in engine.decode.attention.values()) >= FRAMES // 2  # steady plans
    wrappers = [a.wrapper for a in engine.decode.attention.values()]
    # every replay's plan direct, and the capture's second (both staging buffers filled)
    assert sum(w.direct_plans for w in wrappers) == (engine.decode.graphs.replays + len(wrappers) if direct else 0)
    if direct:
        assert all(w.wrapper_plans == 1 for w in wrappers)
    assert engine.scheduler.allocator.used == 0 and not engine.states


def test_captured_frame_steps_of_preempted_requests_give_transformers_codes(tiny_model, cases, monkeypatch):
    """A cache of 20 blocks of 4 tokens, too few for all four requests: some are preempted and recomputed between
    frame steps, each resumed step's plan rebuilt; plans kept where flashinfer's would not change (the stand-in
    checks that the kept tiles cover every row)."""
    data, spec = cases
    engine = captured(tiny_model, monkeypatch, 4, overlap=True, decode_direct_plan=True, graph_sampling=True,
                      kv_blocks=20, block_size=4, max_batched_tokens=8, decode_keep_plans=True)
    seqs, _ = speak(engine, data, spec, list(data))
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"] and seq.frames, name
    assert engine.scheduler.preemptions > 0 and engine.decode.graphs.replays >= FRAMES - 1
    kept = [a.kept for a in engine.decode.attention.values()]
    assert all(k is not None for k in kept) and sum(k.kept for k in kept) >= FRAMES // 2
    assert engine.scheduler.allocator.used == 0 and not engine.states
