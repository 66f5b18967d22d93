"""The native thinker engine against transformers: greedy tokens, logits and the talker's states, with
requests arriving at different steps, prompts in chunks, and sequences preempted and recomputed."""

import pytest
import torch

from references import Case, Reference, native_thinker, png, thinker_seq, wav
from services.runtime.errors import ResourceExhausted
from services.thinker.engine import NativeThinker

CASES = {
    "text": Case([("user", [("text", "Tell me a story about a cat.")])]),
    "image": Case([("user", [("image", png(1)), ("text", "What is in this picture?")])]),
    "audio": Case([("user", [("audio", wav(2, 1.5)), ("text", "What do you hear?")])]),
    "mixed": Case([("system", [("text", "terse")]),
                   ("user", [("image", png(3, 96, 64)), ("audio", wav(4)), ("text", "compare"), ("image", png(5))])]),
}
ENGINES = {
    # as served: decode steps overlapped, other steps in pieces between attentions (graphs on a GPU, eager here)
    "as served": {},
    "whole forwards, plain steps": {"overlap": False, "step_graphs": 0},
    "chunked prefill": {"max_batched_tokens": 7},
    "preemption": {"kv_blocks": 24, "block_size": 4, "max_batched_tokens": 9, "overlap": False, "step_graphs": 0},
    "grouped experts": {"moe": "grouped"},
    "overlap and preemption": {"kv_blocks": 24, "block_size": 4, "max_batched_tokens": 9, "step_graphs": 0},
    "pieces, preemption": {"step_graphs": 16, "kv_blocks": 24, "block_size": 4, "max_batched_tokens": 9},
}
N = 12


@pytest.fixture(scope="module")
def reference(tiny_model, hf_model):
    return Reference(tiny_model, hf_model)


@pytest.fixture(scope="module")
def expected(reference):
    return {name: reference.generate(case, N)[0] for name, case in CASES.items()}


def run_staggered(engine, seqs: list) -> list:
    """One more request arrives at every step; finished ones are freed as the server would."""
    pending, active, outputs = list(seqs), [], {id(s): [] for s in seqs}
    while pending or any(not s.done for s in active):
        if pending:
            active.append(pending.pop(0))
            engine.add(active[-1])
        for seq, out in engine.step([s for s in active if not s.done]):
            outputs[id(seq)].append(out)
        for s in active:
            if s.done and id(s) in engine.states:
                engine.free(s)
    return [outputs[id(s)] for s in seqs]


@pytest.mark.parametrize("setup", list(ENGINES))
def test_greedy_tokens_equal_transformers(tiny_model, reference, expected, setup):
    engine = native_thinker(tiny_model, **ENGINES[setup])
    seqs = [thinker_seq(reference, case, N) for case in CASES.values()]
    run_staggered(engine, seqs)
    for name, seq in zip(CASES, seqs):
        assert seq.generated == expected[name], name
    if "preemption" in setup:
        assert engine.scheduler.preemptions > 0
    if engine.overlap:
        assert engine.overlapped >= N // 2 and engine.pending is None
    if engine.pieces is not None:  # every step: no decode graph on the CPU
        assert engine.pieces.steps > N
    assert engine.scheduler.allocator.used == 0 and not engine.states


@pytest.mark.parametrize("setup", ["as served", "whole forwards, plain steps", "preemption", "overlap and preemption",
                                   "pieces, preemption"])
def test_states_for_the_talker_equal_transformers_hidden_states(tiny_model, reference, setup):
    """Input embeddings and the accept layer's output, each position once and in order."""
    engine = native_thinker(tiny_model, **ENGINES[setup])
    accept = reference.spec.talker["accept_hidden_layer"]
    seqs = [thinker_seq(reference, case, N, return_states=True) for case in CASES.values()]
    for (name, case), seq, outs in zip(CASES.items(), seqs, run_staggered(engine, seqs)):
        kw = reference.inputs(case)
        with torch.no_grad():
            ref = reference.hf.thinker.generate(**kw, max_new_tokens=N, do_sample=False, output_hidden_states=True,
                                                return_dict_in_generate=True, eos_token_id=reference.spec.raw["im_end_token_id"])
        ref_embeds = torch.cat([h[0][0] for h in ref.hidden_states])
        ref_hidden = torch.cat([h[accept][0] for h in ref.hidden_states])
        starts = [o.state_start for o in outs if o.embeds is not None]
        embeds = torch.cat([o.embeds for o in outs if o.embeds is not None])
        hidden = torch.cat([o.hidden for o in outs if o.hidden is not None])
        assert starts[0] == 0 and all(b > a for a, b in zip(starts, starts[1:])), name
        assert embeds.shape == ref_embeds.shape, name
        torch.testing.assert_close(embeds, ref_embeds, rtol=0, atol=1e-6)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-5)
    if engine.overlap:
        assert engine.overlapped >= N // 2


@pytest.mark.parametrize("setup", ["as served", "whole forwards, plain steps"])
def test_prefill_logits_match_transformers(tiny_model, reference, setup):
    engine = native_thinker(tiny_model, **ENGINES[setup])
    for case in CASES.values():
        seq = thinker_seq(reference, case, 1)
        kw = reference.inputs(case)
        with torch.no_grad():
            ref = reference.hf.thinker(**kw).logits[0, -1]
        engine.add(seq)
        captured = {}
        head = engine.model.lm_head
        hook = head.register_forward_hook(lambda m, a, out: captured.update(logits=out[-1]))
        engine.step([seq])
        hook.remove()
        engine.free(seq)
        torch.testing.assert_close(captured["logits"], ref, rtol=1e-4, atol=1e-5)


def test_cancel_frees_blocks_and_the_rest_continue(tiny_model, reference, expected):
    engine = native_thinker(tiny_model, kv_blocks=64, block_size=4)
    seqs = [thinker_seq(reference, case, N) for case in CASES.values()]
    for s in seqs:
        engine.add(s)
    for _ in range(3):
        engine.step(seqs)
    used = engine.scheduler.allocator.used
    engine.free(seqs[1])  # the client went away
    assert engine.scheduler.allocator.used < used
    rest = [s for i, s in enumerate(seqs) if i != 1]
    while any(not s.done for s in rest):
        engine.step(rest)
    for name, s in zip(CASES, seqs):
        if s is not seqs[1]:
            assert s.generated == expected[name]
            engine.free(s)
    assert engine.scheduler.allocator.used == 0


def test_a_request_larger_than_the_cache_is_refused(tiny_model, reference):
    engine = native_thinker(tiny_model, kv_blocks=4, block_size=4)
    with pytest.raises(ResourceExhausted, match="more than the KV cache holds"):
        engine.add(thinker_seq(reference, CASES["text"], 8))


def test_compiled_layers_give_the_same_tokens(tiny_model, reference, expected):
    from services.llm.fusion import fuse

    fuse()  # what a GPU engine does itself
    engine = native_thinker(tiny_model, moe="grouped")
    try:
        seqs = [thinker_seq(reference, CASES[name], N) for name in ("text", "image")]
        run_staggered(engine, seqs)
        assert [s.generated for s in seqs] == [expected["text"], expected["image"]]
    finally:
        fuse(False)  # the layers' functions are per process: give the other tests the eager ones back


def test_overlapped_decode_gives_the_tokens_of_the_plain_one(tiny_model, reference):
    """Greedy and seeded sampling, a stop token met mid-way, a request cancelled mid-way and one with a
    repetition penalty (never overlapped) sharing steps: each request gets the same tokens with overlap as
    without, the cancelled one up to its cancel, and nothing is held afterwards."""
    from dataclasses import replace

    def run(overlap: bool, stop: tuple = ()) -> tuple[list[list[int]], NativeThinker]:
        engine = native_thinker(tiny_model, overlap=overlap)
        seqs = [replace(thinker_seq(reference, case, 14), request_id=f"r{i}{name}") for i in range(2) for name, case in CASES.items()]
        for i, s in enumerate(seqs):
            s.params = replace(s.params, temperature=0.0 if i % 3 == 0 else 0.8, top_k=0 if i % 3 == 0 else 20, seed=i + 1,
                               repetition_penalty=1.3 if i == 7 else 1.0, max_tokens=5 if i == 7 else 14,
                               stop_token_ids=stop or s.params.stop_token_ids)
        active, got = [], {id(s): [] for s in seqs}
        for step in range(200):
            if seqs[len(active):] and step % 2 == 0:  # arrivals every other step
                active.append(seqs[len(active)])
                engine.add(active[-1])
            if step == 12 and not active[1].done:  # cancelled as the server would: freed, never stepped again
                engine.free(active[1])
                active[1].done = True
            for seq, out in engine.step([s for s in active if not s.done]):
                got[id(seq)].extend(out.token_ids)
            for s in active:
                if s.done and id(s) in engine.states:
                    engine.free(s)
            if len(active) == len(seqs) and all(s.done for s in active):
                break
        return [got[id(s)] for s in seqs], engine

    plain, _ = run(False)
    stop = (plain[2][5],)  # a token request 2 draws mid-way: it (and any other drawing it) stops there
    plain, _ = run(False, stop)
    overlapped, engine = run(True, stop)
    cut = len(overlapped[1])  # cancelled: tokens reach a request one step later with overlap, so it got one fewer
    assert overlapped[1] == plain[1][:cut] and cut >= len(plain[1]) - 1
    assert overlapped[:1] + overlapped[2:] == plain[:1] + plain[2:]
    assert len(plain[2]) == 6 and 0 < len(plain[1]) < 14 and any(len(t) == 14 for t in plain)
    assert engine.overlapped > 5 and engine.scheduler.allocator.used == 0 and not engine.states


def test_a_captured_steps_own_draw_stands_for_the_sampler_where_it_can():
    """A decode graph draws with sample_tensors over its best CANDIDATES logits: for every row tensor_drawable
    admits, the token sample_batch draws (same seeds and counters); rows it refuses are the sampler's alone."""
    from services.llm.sampling import CANDIDATES, SamplingParams, sample_batch, sample_tensors, tensor_drawable

    def graph_drawable(p, generated):
        return tensor_drawable(p, generated, CANDIDATES)

    drawable = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3),
                SamplingParams(temperature=1.0, top_k=CANDIDATES - 1, seed=9), SamplingParams(temperature=0.5, top_k=1, seed=2),
                SamplingParams(temperature=0.7, top_k=20, min_tokens=4, stop_token_ids=(7,), seed=5)]  # past its minimum
    counters = [0, 12, 3, 40, 4]
    assert all(graph_drawable(p, c) for p, c in zip(drawable, counters))
    refused = [(SamplingParams(temperature=0.7, top_k=0, seed=1), 0), (SamplingParams(temperature=0.7, top_k=CANDIDATES), 0),
               (SamplingParams(repetition_penalty=1.1), 0), (SamplingParams(min_tokens=4, stop_token_ids=(7,)), 3)]
    assert not any(graph_drawable(p, c) for p, c in refused)
    logits = torch.randn(5, 500, generator=torch.Generator().manual_seed(0)) * 3
    for step in range(30):
        c = [x + step for x in counters]
        expected = sample_batch(logits, drawable, counters=c)
        got = sample_tensors(logits, torch.tensor([p.temperature for p in drawable]), torch.tensor([p.top_k for p in drawable]),
                             torch.tensor([p.top_p for p in drawable]), torch.tensor([p.seed for p in drawable]),
                             torch.tensor(c), CANDIDATES)
        assert got.tolist() == expected.tolist(), step


def test_a_requests_prompt_length_is_kept_with_it():
    """ThinkerSeq.prompt_len: the prompt's length as an int (the decode step's checks read it for every row),
    made again by dataclasses.replace with another prompt."""
    from dataclasses import replace

    from services.llm.sampling import SamplingParams
    from services.thinker.seq import ThinkerSeq

    seq = ThinkerSeq("r", torch.arange(7), SamplingParams())
    assert seq.prompt_len == 7 and type(seq.prompt_len) is int
    assert replace(seq, prompt_ids=torch.arange(3)).prompt_len == 3
