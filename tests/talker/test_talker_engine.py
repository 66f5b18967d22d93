"""The native talker engine against transformers' generate(): the same codes and waveform for several
speech requests batched together, with the thinker's states arriving one per step, prompts in chunks
and requests preempted and recomputed."""

import numpy as np
import pytest
import torch

from references import Case, Reference, native_talker, png, wav
from services.model.positions import Layout
from services.llm.sampling import SamplingParams
from services.model.spec import audio_tokens
from services.talker.seq import TalkerSeq

CASES = {
    "text": Case([("user", [("text", "Tell me a story about a cat.")])]),
    "image": Case([("user", [("image", png(1)), ("text", "What is in this picture?")])]),
    "audio": Case([("user", [("audio", wav(2, 1.5)), ("text", "What do you hear?")])]),
    "mixed": Case([("system", [("text", "terse")]), ("user", [("image", png(3, 96, 64)), ("audio", wav(4)), ("text", "compare")])]),
}
ENGINES = {
    # as served: frame steps overlapped (each step's codes read after the next step is launched), prompts in pieces
    # between attentions (graphs on a GPU, eager here), code2wav's decoder our own
    "as served": {},
    "whole forwards, plain steps": {"overlap": False, "step_graphs": 0},
    "chunked prefill": {"max_batched_tokens": 5},
    "preemption": {"kv_blocks": 20, "block_size": 4, "max_batched_tokens": 8, "overlap": False, "step_graphs": 0},
    "grouped experts": {"moe": "grouped"},
    "audio handed out late": {},  # as on a GPU's side stream: code2wav complete a few steps after its launch
    "overlap and preemption": {"kv_blocks": 20, "block_size": 4, "max_batched_tokens": 8, "step_graphs": 0},
    # the layers compiled (inductor on the CPU here: what fuse() does on a GPU), the same codes
    "compiled": {"compile": True},
    # code2wav's chunks replayed from "graphs" of the plan's chunk lengths (on a GPU: capture_code2wav; their bodies
    # run eagerly here), a request's shorter last chunk padded to one of them: the same waveforms
    "code2wav from graphs": {},
    "pieces, overlap and preemption": {"step_graphs": 8, "kv_blocks": 20, "block_size": 4, "max_batched_tokens": 8},
}
CHUNKS = [4, 8]
TOKENS, FRAMES = 10, 14


@pytest.fixture(scope="module")
def cases(tiny_model, hf_model):
    """Per case: the talker's inputs from transformers' thinker, and transformers' codes and waveform."""
    ref = Reference(tiny_model, hf_model)
    spec, out = ref.spec, {}
    for name, case in CASES.items():
        kw = ref.inputs(case)
        _, codes, wave = ref.generate(case, TOKENS, speech=True, frames=FRAMES)
        with torch.no_grad():
            r = hf_model.thinker.generate(**kw, max_new_tokens=TOKENS, do_sample=False, output_hidden_states=True,
                                          return_dict_in_generate=True, eos_token_id=spec.raw["im_end_token_id"])
            tts = hf_model.thinker.get_input_embeddings()(torch.tensor(
                [spec.raw[k] for k in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id")]))
        accept = spec.talker["accept_hidden_layer"]
        layout = Layout(image_grid_thw=[tuple(g.tolist()) for g in kw.get("image_grid_thw", [])],
                        audio_tokens=[audio_tokens(int(n)) for n in kw["feature_attention_mask"].sum(-1)] if "feature_attention_mask" in kw else [])
        out[name] = dict(ids=kw["input_ids"][0], layout=layout, tts=tts, codes=codes, wave=wave,
                         embeds=torch.cat([h[0][0] for h in r.hidden_states]), hidden=torch.cat([h[accept][0] for h in r.hidden_states]))
    return out, spec


class LateEvent:
    """The side stream's event after a code2wav launch, on the CPU: complete after a few queries, or once it or
    a later launch's event is waited for (one stream: work completes in launch order)."""

    def __init__(self, queries: int, launched: list):
        self.left, self.launched, self.polled_early = queries, launched, 0
        launched.append(self)

    def query(self) -> bool:
        self.left -= 1
        self.polled_early += self.left >= 0
        return self.left < 0

    def synchronize(self) -> None:
        for event in self.launched[:self.launched.index(self) + 1]:
            event.left = -1

    def elapsed_time(self, end) -> float:
        return 1.0


def late(launch):
    launched = []

    def launched_late(group):
        job = launch(group)
        job.begin, job.end = LateEvent(0, []), LateEvent(3, launched)
        return job
    launched_late.events = launched
    return launched_late


@pytest.mark.parametrize("setup", list(ENGINES))
def test_batched_speech_equals_transformers(tiny_model, cases, setup, request, monkeypatch):
    data, spec = cases
    overrides = dict(ENGINES[setup])
    if overrides.pop("compile", False):  # fuse() swaps the compiled functions in for the whole process: back after
        from services.llm.fusion import fuse

        fuse()
        request.addfinalizer(lambda: fuse(False))
    engine = native_talker(tiny_model, chunks=CHUNKS, **overrides)
    # Nothing records autograd (captured steps would, and compiled layers would keep a variant for it).
    assert not any(p.requires_grad for m in (engine.talker, engine.code2wav) for p in m.parameters())
    if setup == "audio handed out late":
        engine._launch = late(engine._launch)
    if "from graphs" in setup:
        from stand_ins import eager_graphs

        eager_graphs(monkeypatch)
        engine.capture_code2wav(4)
        lengths, launch = [], engine._launch  # each launch's chunk length, context included
        engine._launch = lambda group: lengths.append(group[0][2] - group[0][1] + group[0][3]) or launch(group)
    seqs, fed, chunks = {}, {}, {name: [] for name in data}
    for name, d in data.items():
        seq = TalkerSeq(name, d["ids"], d["layout"], spec.voices["ethan"], SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), d["tts"])
        engine.add(seq)
        n = len(d["ids"])
        seq.inbox.append((d["embeds"][:n], d["hidden"][:n]))
        seqs[name], fed[name] = seq, n
    for _ in range(500):
        if all(s.done for s in seqs.values()):
            break
        for name, seq in seqs.items():  # the thinker's states arrive one position per step
            d = data[name]
            if fed[name] < len(d["embeds"]):
                seq.inbox.append((d["embeds"][fed[name]:fed[name] + 1], d["hidden"][fed[name]:fed[name] + 1]))
                fed[name] += 1
            else:
                seq.text_ended = True
        ready = [s for s in seqs.values() if engine.ready(s)]
        for seq, out in engine.step(ready) if ready else []:
            assert out.chunks or out.finished  # nothing posted to a request's RPC for a step without news
            chunks[seq.request_id] += out.chunks
        for seq in seqs.values():
            if seq.done and id(seq) in engine.states:
                engine.free(seq)
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"] and seq.frames, name
        order = [seq.marks[m] for m in ("arrived", "ready", "admitted", "first_frame", "first_audio")]
        assert order == sorted(order) and len(seq.first_audio_split()) == 4, seq.marks
        frame, sample, wave = 0, 0, data[name]["wave"]
        for chunk in chunks[name]:  # one after the other without a gap, as transformers' one decode gives them
            assert chunk.first_frame == frame
            ref = wave[sample:sample + len(chunk.pcm)]
            assert len(ref) == len(chunk.pcm) and np.abs(chunk.pcm - ref).max() < 1e-5, name
            frame, sample = frame + len(chunk.codes), sample + len(chunk.pcm)
        assert frame == len(seq.frames) and sample == len(wave)
    if "preemption" in setup:
        assert engine.scheduler.preemptions > 0
    assert (engine.overlapped > 0) == engine.overlap
    if engine.pieces is not None:  # every step: no decode graph on the CPU
        assert engine.pieces.steps >= FRAMES
    if setup == "audio handed out late":  # chunks went out in steps after their launch's
        assert sum(e.polled_early for e in engine._launch.events) > 0 and not engine.vocoding
    if "from graphs" in setup:  # every chunk from a graph, last ones of lengths no graph has among them (padded)
        assert sum(g.replays for _, g, _ in engine.c2w_graphs.values()) == len(lengths)
        assert set(lengths) - set(engine.c2w_graphs), lengths
    assert engine.scheduler.allocator.used == 0 and not engine.states


def speak(engine, data, spec, names, frames: int = FRAMES) -> tuple[dict, dict]:
    """Requests for `names` with every thinker state at once, stepped as the engine worker does; their seqs and chunks."""
    seqs, chunks = {}, {name: [] for name in names}
    for name in names:
        d = data[name]
        seq = TalkerSeq(name, d["ids"], d["layout"], spec.voices["ethan"], SamplingParams(max_tokens=frames, repetition_penalty=1.05), d["tts"])
        engine.add(seq)
        seq.inbox.append((d["embeds"], d["hidden"]))
        seq.text_ended = True
        seqs[name] = seq
    while ready := [s for s in seqs.values() if engine.ready(s)]:
        for seq, out in engine.step(ready):
            chunks[seq.request_id] += out.chunks
        for seq in seqs.values():
            if seq.done and id(seq) in engine.states:
                engine.free(seq)
    return seqs, chunks


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_ending_on_the_end_code(tiny_model, cases, overlap):
    """The end code drawn for one request at its sixth frame (forced): it stops with eos after five frames, all
    their audio out by its last step, the others run to their length. Overlapped, the frame launched for it
    before the end code was read is dropped."""
    data, spec = cases
    engine = native_talker(tiny_model, chunks=CHUNKS, overlap=overlap)
    draw = engine._sample_first

    def ends_at_five(seqs, logits):
        code0 = draw(seqs, logits)
        for i, s in enumerate(seqs):
            if s.request_id == "image" and len(s.frames) + s.frames_unread == 5:
                code0[i] = engine.codec_eos
        return code0

    engine._sample_first = ends_at_five
    seqs, chunks = speak(engine, data, spec, ["text", "image", "audio"])
    for name, seq in seqs.items():
        expected = data[name]["codes"][:5] if name == "image" else data[name]["codes"]
        ended = name == "image" or len(expected) < FRAMES  # transformers' own may end on the end code too
        assert seq.frames == expected and seq.eos == ended and seq.done, name
        assert sum(len(c.codes) for c in chunks[name]) == len(seq.frames), name
    assert engine.scheduler.allocator.used == 0 and not engine.states and not engine.vocoding
    assert sorted(engine.free_slots) == list(range(len(engine.seen) - 1))  # the last row: padding rows'


def test_a_strong_repetition_penalty_counts_codes_not_yet_read(tiny_model, hf_model, cases):
    """Penalty 3.0, which changes the codes here (1.05 changes none of these): transformers' codes, plain and
    overlapped; overlapped, a frame's first code is drawn before the one before it is read, so the penalty
    must come from what the device has drawn, not from the frames the host holds."""
    from references import Reference

    data, spec = cases
    ref = Reference(tiny_model, hf_model)
    _, expected, _ = ref.generate(CASES["text"], TOKENS, speech=True, frames=FRAMES, repetition_penalty=3.0)
    assert expected != data["text"]["codes"]
    for overlap in (False, True):
        engine = native_talker(tiny_model, overlap=overlap)
        d = data["text"]
        seq = TalkerSeq("text", d["ids"], d["layout"], spec.voices["ethan"], SamplingParams(max_tokens=FRAMES, repetition_penalty=3.0), d["tts"])
        engine.add(seq)
        seq.inbox.append((d["embeds"], d["hidden"]))
        seq.text_ended = True
        while ready := [s for s in [seq] if engine.ready(s)]:
            engine.step(ready)
        assert seq.frames == expected, overlap
        assert (engine.overlapped > 0) == overlap


def test_a_request_larger_than_the_cache_is_refused(tiny_model, cases):
    from services.runtime.errors import ResourceExhausted

    data, spec = cases
    d = data["text"]
    engine = native_talker(tiny_model, kv_blocks=8, block_size=4)
    seq = TalkerSeq("big", d["ids"], d["layout"], spec.voices["ethan"], SamplingParams(max_tokens=100), d["tts"])
    with pytest.raises(ResourceExhausted, match="more than the talker's KV cache holds"):
        engine.add(seq)


def test_seeded_speech_repeats_whatever_shares_its_steps(tiny_model, cases):
    """Sampled speech (talker and code predictor) from a seed: the same codes alone, batched with another
    request or overlapped (each frame's draws keyed by its own index, read or not), other codes from another seed."""
    data, spec = cases
    d, other = data["text"], data["image"]

    def speak(seed: int, with_other: bool, overlap: bool = False) -> list:
        engine = native_talker(tiny_model, overlap=overlap)
        seqs = []
        for name, x, s in [("a", d, seed)] + ([("b", other, 99)] if with_other else []):
            seq = TalkerSeq(name, x["ids"], x["layout"], spec.voices["ethan"],
                            SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=s, ignore_eos=True), x["tts"])
            engine.add(seq)
            seq.inbox.append((x["embeds"], x["hidden"]))
            seq.text_ended = True
            seqs.append(seq)
        while ready := [s for s in seqs if engine.ready(s)]:
            engine.step(ready)
        return seqs[0].frames

    alone = speak(5, False)
    assert len(alone) == 8
    assert speak(5, True) == alone
    assert speak(5, True, overlap=True) == alone
    assert speak(6, False) != alone


def test_a_predictor_frame_does_not_depend_on_padding_rows(tiny_model):
    """What a captured frame relies on: rows past the real ones (greedy, zero inputs) change nothing of theirs."""
    engine = native_talker(tiny_model, max_seqs=8)
    vocab = engine.talker.get_input_embeddings().num_embeddings

    def frame(b: int):
        engine.predictor.ints.zero_()
        engine.predictor.floats.zero_()
        engine.predictor.hidden.zero_()
        engine.predictor.ints[:, :2] = torch.tensor([[3, vocab - 5], [50, 50], [5, 0], [3 * 16, 7 * 16]])
        engine.predictor.floats[:, :2] = torch.tensor([[0.9, 0.0], [0.8, 1.0]])
        engine.predictor.hidden[:2] = torch.randn(2, engine.predictor.hidden.shape[1], generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            return engine.predictor.body(b)

    codes, embeds = frame(2)
    padded_codes, padded_embeds = frame(5)
    assert torch.equal(padded_codes[:2], codes)
    torch.testing.assert_close(padded_embeds[:2], embeds)


def test_a_steps_inputs_are_its_queued_rows_in_the_works_order(tiny_model):
    """A decode step's inputs are the tensor this step's inputs were queued in: as it is when the work takes them
    in queued order, gathered into the work's order otherwise, and each request's own last row joined where one
    was not queued this step (the batched speech tests only ever take the first way)."""
    from services.llm.scheduler import Work
    from services.talker.engine import TalkerState

    engine = native_talker(tiny_model, max_seqs=8)
    g = torch.Generator().manual_seed(0)
    d = engine.talker.config.text_config.hidden_size

    def state(rows: int) -> TalkerState:
        return TalkerState(tokens=[0] * rows, inputs=[torch.randn(rows, d, generator=g)], positions=[torch.zeros(3, rows)])

    states = [state(2) for _ in range(3)]
    queued = torch.stack([st.inputs[-1][1] for st in states])  # each request's last input, as _queue_inputs stacks them
    engine.queued = queued, {id(st): j for j, st in enumerate(states)}
    work = [Work(st, 1, 1) for st in states]
    assert engine._step_inputs(work) is queued
    assert torch.equal(engine._step_inputs(work[::-1]), queued.flip(0))
    other = state(1)  # its last input queued in an earlier step
    assert torch.equal(engine._step_inputs([work[2], Work(other, 0, 1)]), torch.cat([queued[2:], other.inputs[0]]))
    engine.queued = None  # nothing queued this step
    assert torch.equal(engine._step_inputs(work[:2]), queued[:2])


def test_a_requests_frame_inputs_kept_as_their_steps_rows_read_back_as_its_own():
    """A frame's input is kept as (the step's inputs, row) and (its positions, column): read back, the last as its
    one row, and a recompute's reach into older ones joins the prompt's rows and every frame's, in order."""
    from services.talker.engine import TalkerState

    prompt, pos = torch.arange(6.0).view(3, 2), torch.arange(9.0).view(3, 3)
    steps = [torch.arange(8.0).view(4, 2) + 100 * k for k in (1, 2)]  # two steps' inputs, 4 requests each
    step_pos = [torch.arange(12.0).view(3, 4) + 100 * k for k in (1, 2)]
    st = TalkerState(tokens=[0] * 5, inputs=[prompt, (steps[0], 2), (steps[1], 3)],
                     positions=[pos, (step_pos[0], 2), (step_pos[1], 3)])
    x, p = st.rows(4, 1)
    assert x.tolist() == [[206.0, 207.0]] and p.tolist() == [[203.0], [207.0], [211.0]]
    x, p = st.rows(1, 4)  # a recompute from row 1: everything joined once
    assert x.tolist() == [[2.0, 3.0], [4.0, 5.0], [104.0, 105.0], [206.0, 207.0]]
    assert p[:, 2:].tolist() == [[102.0, 203.0], [106.0, 207.0], [110.0, 211.0]] and len(st.inputs) == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_preempted_between_frames_draws_no_frame_twice(tiny_model, cases, overlap):
    """A request whose last row is computed and its frame drawn, waiting for the text of its next input, is
    preempted (its KV freed); recomputing its rows reaches the same row again and must not draw that frame
    a second time: its codes stay transformers'."""
    data, spec = cases
    d = data["text"]
    engine = native_talker(tiny_model, chunks=CHUNKS, overlap=overlap)
    seq = TalkerSeq("text", d["ids"], d["layout"], spec.voices["ethan"], SamplingParams(max_tokens=FRAMES, repetition_penalty=1.05), d["tts"])
    engine.add(seq)
    n = len(d["ids"])
    fed = n + 4  # text for the first three frames' inputs only: then it waits
    seq.inbox.append((d["embeds"][:fed], d["hidden"][:fed]))
    preempted = False
    for _ in range(200):
        if seq.done:
            break
        if not engine.ready(seq):
            state = engine.states[id(seq)]
            if not preempted and state.pending == 0 and engine.pending is None and seq.frames_unread == 0:
                engine.scheduler._preempt(state)  # what a full cache does to the most recent request
                preempted = True  # its rows are recomputed in the next steps, the text still to come
                continue
            seq.inbox.append((d["embeds"][fed:], d["hidden"][fed:]))
            seq.text_ended = True
            continue
        engine.step([seq])
    assert preempted and seq.frames == d["codes"]


def test_talker_and_predictor_logits_equal_transformers_on_the_same_weights(tiny_model):
    """Our talker LM with its codec head, and our code predictor's first step, against transformers' modules
    holding the very same tensors (float32): a 40-row prompt through our paged cache, and four frames' second codes."""
    from references import hf_predictor_logits, hf_talker_logits, hf_talker_sharing, predictor_logits, talker_logits

    engine = native_talker(tiny_model, max_seqs=8)
    hf = hf_talker_sharing(tiny_model, engine.talker, "cpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, engine.predictor.hidden.shape[1], generator=g)
    ours, ref = talker_logits(engine, x), hf_talker_logits(hf, x)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    vocab = engine.talker.get_input_embeddings().num_embeddings
    hidden, code0 = torch.randn(4, x.shape[1], generator=g), torch.tensor([0, 7, vocab // 2, vocab - 1])
    torch.testing.assert_close(predictor_logits(engine, hidden, code0), hf_predictor_logits(hf, hidden, code0),
                               rtol=1e-4, atol=1e-4)


def test_chunk_plans():
    """The streaming plan: the default's three shapes; a first chunk growing twice over up to the full size;
    every chunk's left context is all the frames before it, up to the context."""
    from services.talker.chunks import chunk_plan

    assert chunk_plan([5, 25], 25) == [(5, 5), (30, 25), (50, 25)]
    assert chunk_plan([2, 4, 8, 16, 25], 25) == [(2, 2), (6, 4), (14, 8), (30, 16), (50, 25)]
    assert chunk_plan([4, 8], 25) == [(4, 4), (12, 8), (20, 8), (28, 8), (33, 8)]
    assert chunk_plan([3, 4, 6, 9, 10], 4) == [(3, 3), (7, 4), (10, 6), (13, 9), (14, 10)]


def test_growing_chunks_equal_transformers(tiny_model, cases):
    """Chunks of 2, 4, then 8 frames (a request's last: what is left), each the reference decode's samples (every
    frame before it is its context)."""
    data, spec = cases
    engine = native_talker(tiny_model, chunks=[2, 4, 8])
    seqs, chunks = speak(engine, data, spec, list(data))
    for name, seq in seqs.items():
        assert seq.frames == data[name]["codes"], name
        left, plan = len(seq.frames), []
        for size in (2, 4, 8, 8, 8):
            plan += [min(size, left)] if left > 0 else []
            left -= size
        assert [len(c.codes) for c in chunks[name]] == plan, name
        sample, wave = 0, data[name]["wave"]
        for chunk in chunks[name]:  # joined without a gap
            ref = wave[sample:sample + len(chunk.pcm)]
            assert len(ref) == len(chunk.pcm) and np.abs(chunk.pcm - ref).max() < 1e-5, (name, sample)
            sample += len(chunk.pcm)
        assert sample == len(wave), name
    assert max(len(c) for c in chunks.values()) >= 3  # the growth reached its third chunk somewhere


def test_first_codes_drawn_with_tensor_settings_equal_the_samplers(tiny_model):
    """draw_first (what a captured frame step runs) gives every row `_sample_first`'s
    code: greedy and seeded top-k rows, with and without a repetition penalty over codes already drawn, the end
    code allowed or banned (ignore_eos), on bf16 logits with ties; the codes it marks seen are the ones drawn."""
    from types import SimpleNamespace

    from services.talker.decode import draw_first

    engine = native_talker(tiny_model, max_seqs=8)
    vocab = engine.talker.codec_head.out_features
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, top_p=0.8, seed=7),
              SamplingParams(temperature=0.9, top_k=50, seed=8, repetition_penalty=1.3),
              SamplingParams(repetition_penalty=1.3, ignore_eos=True), SamplingParams(temperature=1.0, top_k=10, seed=9, ignore_eos=True)]
    seqs = [SimpleNamespace(params=p, frames=[0] * (3 + i), frames_unread=i % 2) for i, p in enumerate(params)]
    for i, s in enumerate(seqs):
        engine.states[id(s)] = SimpleNamespace(slot=i)
    engine.seen[:len(seqs)] = torch.rand(len(seqs), vocab, generator=gen) < 0.3
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[engine.suppress] = True
    eos = torch.zeros(vocab, dtype=torch.bool)
    eos[engine.codec_eos] = True
    t = torch.tensor
    for step in range(8):
        logits = (torch.randn(len(seqs), vocab, generator=gen) * 4).to(torch.bfloat16)
        logits[[0, 3, 4], engine.codec_eos] = logits.max() + 1  # the end code best: the greedy row takes it, banned ones not
        before = engine.seen.clone()
        for s in seqs:
            s.frames.append(0)
        frames = [len(s.frames) + s.frames_unread for s in seqs]  # each row's draw counter, as _sample_first counts
        drawn = draw_first(logits, before[:len(seqs)], t([p.repetition_penalty for p in params]), suppress,
                           t([int(p.ignore_eos) for p in params]), eos, t([p.temperature for p in params]),
                           t([p.top_k for p in params]), t([p.top_p for p in params]), t([p.seed for p in params]), t(frames))
        eager = engine._sample_first(seqs, logits)
        assert drawn.tolist() == eager.tolist(), step
        assert drawn[3] != engine.codec_eos and drawn[4] != engine.codec_eos and drawn[0] == engine.codec_eos
        marked = before.clone()
        marked[torch.arange(len(seqs)), drawn] = True
        assert torch.equal(engine.seen, marked)
