"""The native talker at full size on one GPU (seeded random weights, bf16): the code predictor's frame and
the talker's decode step (Triton experts) replayed from their CUDA graphs give what they give run eagerly."""

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def native(model_dir, **overrides):
    """The native talker on cuda:0 over seeded random weights, as served but for `overrides` of its config."""
    from services.runtime.config import ModelConfig, TalkerConfig
    from services.talker.engine import NativeTalker

    return NativeTalker(ModelConfig(path=str(model_dir), load_format="random"), TalkerConfig(**overrides), "cuda:0")


def test_captured_predictor_frame_equals_the_eager_one(tmp_path):
    from services.model.build import build_full_skeleton

    engine = native(build_full_skeleton(tmp_path / "model"), kv_blocks=256, max_seqs=16, moe="grouped",
                    cuda_graph_max_batch=8, step_graphs=0)
    assert engine.predictor.graphs is not None and engine.predictor.graphs.size_for(3) == 4
    vocab = engine.talker.get_input_embeddings().num_embeddings

    def fill():
        engine.predictor.ints.zero_()
        engine.predictor.floats.zero_()
        engine.predictor.hidden.zero_()
        engine.predictor.ints[:, :3] = torch.tensor([[5, 900, vocab - 1030], [50, 50, 50], [0, 7, 9], [0, 32, 64]])
        engine.predictor.floats[:, :3] = torch.tensor([[0.0, 0.9, 1.0], [1.0, 0.8, 0.8]])
        engine.predictor.hidden[:3] = torch.randn(3, engine.predictor.hidden.shape[1], generator=torch.Generator().manual_seed(0)).cuda()

    with torch.no_grad():
        fill()
        codes, embeds = (t.clone() for t in engine.predictor.body(4))
        fill()
        g_codes, g_embeds = engine.predictor.graphs.replay(4)
    assert torch.equal(g_codes[:3], codes[:3])  # greedy and seeded rows alike
    torch.testing.assert_close(g_embeds[:3], embeds[:3], rtol=0, atol=0)


def speech_requests(engine, model_dir, frames: int = 40, seed: int = 1) -> list:
    """Three speech requests of different prompt lengths, every thinker state in their inboxes, text ended."""
    from services.model.positions import Layout
    from services.llm.sampling import SamplingParams
    from services.talker.seq import TalkerSeq
    from transformers import AutoTokenizer

    spec, gen = engine.spec, torch.Generator().manual_seed(seed)
    hidden = spec.thinker_hidden
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = []
    for i, words in enumerate((3, 12, 25)):  # a user turn and the assistant's opening, as the thinker hands them over
        chat = [{"role": "user", "content": " ".join(["speak"] * words)}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"], dtype=torch.long)
        n = len(ids)
        seq = TalkerSeq(f"s{i}", ids, Layout(), spec.voices[spec.default_voice], SamplingParams(max_tokens=frames, ignore_eos=True),
                        tts_embeds=torch.randn(3, hidden, generator=gen) / hidden**0.5)
        seq.inbox.append((torch.randn(n + frames + 1, hidden, generator=gen) / hidden**0.5,
                          torch.randn(n + frames + 1, hidden, generator=gen)))
        seq.text_ended = True
        engine.add(seq)
        seqs.append(seq)
    return seqs


def frames_to_the_end(engine, seqs) -> list:
    """`seqs` stepped until none is ready, each freed once done; their frames."""
    while ready := [s for s in seqs if engine.ready(s)]:
        engine.step(ready)
        for s in seqs:
            if s.done and id(s) in engine.states:
                engine.free(s)
    return [s.frames for s in seqs]


def first_difference(a: list, b: list) -> tuple | None:
    """(request, frame, codebook) where two runs' frames first differ, or None."""
    for i, (fa, fb) in enumerate(zip(a, b)):
        for t, (x, y) in enumerate(zip(fa, fb)):
            if list(x) != list(y):
                return i, t, next(g for g, (u, v) in enumerate(zip(x, y)) if u != v)
    return None


@pytest.mark.parametrize("kernels", [dict(cuda_graph_max_batch=8), dict(cuda_graph_max_batch=0),
                                     dict(cuda_graph_max_batch=0, moe="grouped", attention="torch")],
                         ids=["graphs", "eager", "eager-torch-kernels"])
def test_two_runs_of_one_engine_draw_the_same_codes(tmp_path, kernels):
    """Three greedy requests run twice, then a third time, on one engine, and once on a second engine: every run
    draws the same frames (the tests comparing two variants of one engine rest on this). On the CPU, with graphs
    and flashinfer stood in, they do; here the ids say whether graphs or our kernels make the difference."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    kw = dict(kv_blocks=512, max_seqs=16, step_graphs=0, **kernels)
    engine = native(model_dir, **kw)
    runs = [frames_to_the_end(engine, speech_requests(engine, model_dir)) for _ in range(3)]
    del engine
    other = native(model_dir, **kw)
    runs.append(frames_to_the_end(other, speech_requests(other, model_dir)))
    assert [first_difference(runs[0], r) for r in runs[1:]] == [None] * 3


def test_captured_talker_decode_step_equals_the_eager_one(tmp_path):
    """Three speech requests past their prompts: one decode step replayed from the graph of 4 (a padding row)
    against the same step run eagerly (flashinfer's decode kernel against its prefill kernel, bf16). Twenty
    random layers carry the two kernels' rounding differences to a few percent of a row (measured 1-7%). What
    this can catch is a graph reading another row's input or a stale buffer; a position off by one moves a row of
    this random model by as little (measured 1-8%), which the CPU tests against transformers cover instead."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=0)
    assert engine.decode is not None
    seqs = speech_requests(engine, model_dir)
    with torch.no_grad():
        while not all(len(s.frames) >= 4 for s in seqs):
            engine.step([s for s in seqs if engine.ready(s)])
        engine._queue_inputs([s for s in seqs if s.next_embed is not None])  # every request's decode row queued
        work = engine.scheduler.schedule()
        assert len(work) == 3, [(w.start, w.n) for w in work]
        assert engine._graphable(work), [(w.start, w.n, w.seq.prompt_len, len(w.seq.tokens)) for w in work]
        eager = engine._rows(work).float()
        graph, logits = (t.float() for t in engine._graph_rows(work)[:2])

    def rel(a, b):
        return [round(((a[i] - b[i]).norm() / b[i].norm()).item(), 4) for i in range(len(b))]

    print(f"talker decode step, relative L2 per row, graph against eager: {rel(graph, eager)}")
    assert max(rel(graph, eager)) < 0.12, f"graph against eager: {rel(graph, eager)}"
    assert engine.decode.replays >= 1
    ref_logits = engine.talker.codec_head(eager.to(torch.bfloat16)).float()
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agree >= 2 / 3, f"codec argmax agrees on {agree:.0%} of rows"


def test_prompt_steps_replayed_in_pieces_track_eager_ones(tmp_path):
    """Three requests' prompt rows in one step (padded to the ladder's next count: grouped
    experts) replayed from the pieces' graphs against the same step run eagerly, row by row; then speech to
    the end with the pieces serving every prompt and mixed step."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=512)
    assert engine.pieces is not None and engine.pieces.graphs
    pieces, engine.pieces = engine.pieces, None
    seqs = speech_requests(engine, model_dir)
    with torch.no_grad():
        for s in seqs:
            assert engine.ready(s)  # takes in the thinker's states, which admission reads
            engine._admit(s)
        work = engine.scheduler.schedule()
        assert len(work) == 3 and all(w.start == 0 for w in work)
        rows = sum(w.n for w in work)
        assert rows <= pieces.max_tokens, f"{rows} prompt rows: more than the pieces hold ({pieces.max_tokens})"
        eager = engine._rows(work).float()
        engine.pieces = pieces
        replayed = engine._rows(work).float()
    assert pieces.graphs.replays == 2 * len(engine.talker.model.layers)
    rel = ((replayed - eager).norm(dim=-1) / eager.norm(dim=-1))
    print(f"talker prompt rows ({len(eager)}), pieces against eager, relative L2: max {rel.max().item():.4f}, "
          f"median {rel.median().item():.4f}")
    assert rel.max() < 0.12  # the yardstick of the decode graph's test above: bf16 roundings over 20 random layers
    for s in seqs:
        engine.free(s)
    before = pieces.steps  # one so far: the replayed step above
    frames = frames_to_the_end(engine, speech_requests(engine, model_dir, seed=2))
    assert [len(f) for f in frames] == [40, 40, 40]
    # The three prompts' step is the pieces' (the frame steps after it are the decode graph's).
    assert pieces.steps > before, (before, pieces.steps)


def test_audio_from_the_side_stream_equals_audio_waited_for(tmp_path):
    """code2wav on its own stream, read back once done, hands out the same chunks, in order, as code2wav run
    in the frame loop and waited for; every chunk of a request is out by its last step."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=0)
    assert engine.vocode_stream is not None

    def speak():
        seqs = speech_requests(engine, model_dir)
        chunks = {s.request_id: [] for s in seqs}
        finished_with_all = []
        while not all(s.done for s in seqs):
            for seq, out in engine.step([s for s in seqs if engine.ready(s)]):
                chunks[seq.request_id] += out.chunks
                if out.finished:
                    finished_with_all.append(sum(len(c.codes) for c in chunks[seq.request_id]) == len(seq.frames))
            for s in seqs:
                if s.done and id(s) in engine.states:
                    engine.free(s)
        assert finished_with_all == [True] * 3 and not engine.vocoding
        return [s.frames for s in seqs], {k: [(c.first_frame, c.pcm) for c in v] for k, v in chunks.items()}

    frames, side = speak()
    engine.vocode_stream = None
    frames_waited, waited = speak()
    assert frames == frames_waited
    for name in waited:
        assert [f for f, _ in side[name]] == [f for f, _ in waited[name]], name
        for (_, a), (_, b) in zip(side[name], waited[name]):
            assert np.array_equal(a, b), name


def test_overlapped_frame_steps_give_the_codes_of_plain_ones(tmp_path):
    """Frame steps launched before the previous step's codes are read (the predictor's outputs copied out of its
    graph before the next replay overwrites them) give the codes plain steps give: three greedy requests, the
    same rows in every step either way, so the same kernels on the same inputs."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=0)

    def codes(overlap: bool) -> list:
        engine.overlap = overlap
        seqs = speech_requests(engine, model_dir)
        return frames_to_the_end(engine, seqs)

    plain = codes(False)
    assert engine.overlapped == 0 and all(len(f) == 40 for f in plain)
    assert codes(True) == plain and engine.overlapped > 30


def test_overlapped_frame_steps_never_wait_on_a_blocking_copy(tmp_path):
    """Overlapped steps: once frames flow, a frame step (talker, predictor, code2wav's chunks) waits on the device only
    for the event after the step it reads; torch's sync debug mode raises on any other wait (a copy from pageable
    memory, a value read from the device, a stream synchronised), each of which would start the next step only
    once the device is idle. A Python `True` assigned through the drawn codes as an index was one."""
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=0)
    engine.overlap = True
    seqs = speech_requests(engine, model_dir)
    while min(len(s.frames) for s in seqs) < 4:  # prompts, first frames, first chunks of audio
        engine.step([s for s in seqs if engine.ready(s)])
    before = engine.overlapped
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            engine.step([s for s in seqs if engine.ready(s)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.overlapped - before >= 10 and min(len(s.frames) for s in seqs) >= 14


def test_first_codes_drawn_in_the_captured_step_equal_the_samplers(tmp_path):
    """Frame steps replayed from their graphs draw the first codes there (repetition penalty over codes drawn,
    suppressed codes, seeded top-k); three sampled requests get the frames the sampler after the graph gives them
    (every row refused the graph's draw: _first_drawable patched), frame for frame, plain and overlapped."""
    from dataclasses import replace

    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=512, max_seqs=16, cuda_graph_max_batch=8, step_graphs=0)
    drawable = engine._first_drawable

    def codes(graph_sampling: bool, overlap: bool) -> list:
        engine.overlap = overlap
        engine._first_drawable = drawable if graph_sampling else (lambda seqs: False)
        seqs = speech_requests(engine, model_dir)
        for i, s in enumerate(seqs):
            s.params = replace(s.params, temperature=0.9, top_k=50, top_p=0.95, seed=i + 1, repetition_penalty=1.05)
        return frames_to_the_end(engine, seqs)

    sampler = codes(False, False)
    assert engine.graph_draws == 0 and all(len(f) == 40 for f in sampler)
    assert codes(True, False) == sampler and engine.graph_draws > 30
    assert codes(True, True) == sampler


def test_states_from_host_memory_reach_the_talkers_gpu():
    """A token's states arrive inside the message (inline bytes, read to the host); the
    talker's engine thread uploads them through pinned memory to its GPU, in its dtype, without waiting for the
    work it has queued (a second of it here), and the values arrive whole."""
    from types import SimpleNamespace

    from omni.stage.v1 import tensor_pb2
    from services.runtime.config import TransportConfig
    from services.runtime.transport import Transport
    from services.talker.speech import SpeechEngine

    here = tensor_pb2.Placement(shm_domain="local", cuda=True)
    states = torch.randn(2, 1, 2048).to(torch.bfloat16)
    ref = Transport(TransportConfig(), "hostprod").put([states[0], states[1]], here)
    assert ref.WhichOneof("location") == "inline_data"
    both = Transport(TransportConfig(), "hostcons").get(ref, "cpu")
    engine = SimpleNamespace(device=torch.device("cuda:0"), dtype=torch.bfloat16)
    torch.cuda._sleep(2_000_000_000)  # about a second of queued work on the engine's stream
    t0 = time.perf_counter()
    got = [SpeechEngine._to_device(engine, t) for t in both]
    queued = time.perf_counter() - t0
    assert queued < 0.1, f"the upload waited {queued:.3f} s for queued work"
    assert all(g.device == torch.device("cuda:0") and g.dtype == torch.bfloat16 for g in got)
    assert torch.equal(torch.stack(got).cpu(), states)


def test_code2wav_replayed_from_graphs_equals_it_run_eagerly(tmp_path):
    """The native decoder's chunks replayed from graphs (three requests padded to the graph of 4), each graph
    started where its shape's context lets it: the samples after the context as the native decoder gives them run
    eagerly from the chunk's start, also for a request's last chunk of a captured length with more context than the
    plan's (its graph starts earlier than that chunk needs), and for last chunks of lengths no graph has."""
    from services.model.build import build_full_skeleton
    from services.talker.code2wav import NativeCode2Wav

    engine = native(build_full_skeleton(tmp_path / "model"), kv_blocks=256, max_seqs=16, moe="grouped",
                    cuda_graph_max_batch=8, chunks=[5, 25], step_graphs=0)
    assert isinstance(engine.code2wav, NativeCode2Wav)
    assert sorted(engine.c2w_graphs) == engine.chunk_shapes() == [5, 30, 50]
    gen = torch.Generator().manual_seed(0)
    # contexts 0, 5 and 25 frames, their decodes kept from the chunk before's last 555 samples (engine._skip)
    assert [engine.c2w_graphs[f][2] for f in (5, 30, 50)] == [0, 0, 80]
    # (30, 25): 5 new frames after 25 of context; (3, 0) and (33, 25): a request's last chunks, of lengths no graph
    # has, padded to one that holds them
    for frames, ctx in ((5, 0), (30, 5), (50, 25), (30, 25), (3, 0), (33, 25)):
        codes = torch.randint(0, 2048, (3, frames, engine.groups), generator=gen).tolist()
        skip = engine._skip(ctx)
        with torch.no_grad():
            eager = engine.code2wav(torch.tensor(codes, device="cuda:0").transpose(1, 2))[..., skip:].float()
            got = engine._code2wav(codes, skip).float()
        err = ((got - eager).norm() / eager.norm()).item()
        print(f"native code2wav {frames} frames after {ctx} of context: relative L2 {err:.2e} against eager from frame 0")
        assert got.shape == eager.shape and err < 1e-2


def test_native_code2wav_at_full_size_as_close_to_float32_as_transformers_bf16(tmp_path):
    """The native code2wav on the GPU (cuDNN's channels-last convolutions, the dilated ones folded, cuBLAS's
    pointwise ones, the Triton pass between them), full size in bf16, chunks of the streaming shapes for 4
    requests: its waveforms at least as close to transformers' float32 as transformers' own bf16 (within 1 dB),
    and replayed from a CUDA graph as run eagerly; started where a chunk's samples after 25 frames of context need
    it, those samples as close."""
    from services.llm.graphs import Ladder
    from services.model.build import build_full_skeleton
    from services.model.load import load_component
    from services.talker.code2wav import NativeCode2Wav

    model = build_full_skeleton(tmp_path / "model")
    f32, bf16 = (load_component("code2wav", model, "cuda:0", d, "random", 0).requires_grad_(False)
                 for d in (torch.float32, torch.bfloat16))
    native = NativeCode2Wav(bf16)
    gen = torch.Generator().manual_seed(0)
    snr = lambda wav, ref: -20 * torch.log10((wav.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    for frames in (5, 30, 50):
        codes = torch.randint(0, 2048, (4, 16, frames), generator=gen).to("cuda:0")
        with torch.no_grad():
            ref, theirs, ours = f32(codes), bf16(codes).float(), native(codes).float()
            graph = Ladder([4], lambda b: native(codes[:b]), torch.device("cuda:0"))
            replayed = graph.replay(4).float()
        print(f"code2wav {frames} frames: SNR against float32, transformers bf16 {snr(theirs, ref):.1f} dB, "
              f"native {snr(ours, ref):.1f} dB; graph against eager {snr(replayed, ours):.1f} dB")
        assert ours.shape == ref.shape
        assert snr(ours, ref) > snr(theirs, ref) - 1 and snr(ours, ref) > 30
        assert snr(replayed, ours) > 60
        if frames == 50:
            skip = 25 * 1920
            start = native.first_row(skip)
            with torch.no_grad():
                kept = native(codes, start)[..., skip - start * native.row_samples:].float()
            print(f"code2wav 50 frames from row {start}: SNR of the kept samples {snr(kept, ref[..., skip:]):.1f} dB")
            assert kept.shape == ref[..., skip:].shape and snr(kept, ref[..., skip:]) > snr(theirs, ref) - 1


def test_compiled_predictor_sampling_draws_what_eager_draws():
    """The code predictor's draw as `compile: true` runs it (sample_tensors compiled) against eager, greedy and
    seeded rows (the hashed noise leaves nothing to a generator), as one batch and replayed from a graph."""
    from services.llm.sampling import sample_tensors

    compiled = torch.compile(sample_tensors, dynamic=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, vocab = 24, 2048
    logits = torch.randn(b, vocab, device="cuda", generator=g).to(torch.bfloat16) * 3
    temps = torch.tensor([0.0, 1.0, 0.7] * 8, device="cuda")
    top_k = torch.tensor([50, 50, 20] * 8, device="cuda")
    top_p = torch.tensor([1.0, 0.8, 0.95] * 8, device="cuda")
    seeds = torch.arange(1, b + 1, device="cuda") * 7919
    counters = torch.arange(b, device="cuda") * 15
    eager = sample_tensors(logits, temps, top_k, top_p, seeds, counters, 50)
    assert torch.equal(compiled(logits, temps, top_k, top_p, seeds, counters, 50), eager)
    with torch.no_grad():  # as graphs.Graphs does: every size run (compiled) before any capture
        compiled(logits[:8], temps[:8], top_k[:8], top_p[:8], seeds[:8], counters[:8], 50)
        compiled(logits, temps, top_k, top_p, seeds, counters, 50)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(logits, temps, top_k, top_p, seeds, counters, 50)
        graph.replay()
    assert torch.equal(out, eager)


def test_talker_and_predictor_logits_match_transformers(tmp_path):
    """Full size, bf16: our talker's codec logits over a 256-row prompt (flashinfer over the paged cache, the
    grouped GEMM's experts; M-RoPE rows that differ) and our code predictor's first step for eight frames,
    against transformers' talker and code predictor holding the same tensors. The yardstick is how far
    transformers' own result moves when only its attention kernel changes (sdpa against eager)."""
    from references import hf_predictor_logits, hf_talker_logits, hf_talker_sharing, predictor_logits, talker_logits
    from services.model.build import build_full_skeleton

    model_dir = build_full_skeleton(tmp_path / "model")
    engine = native(model_dir, kv_blocks=256, max_seqs=16, cuda_graph_max_batch=0, step_graphs=0)
    hf = hf_talker_sharing(model_dir, engine.talker, "cuda:0")
    g = torch.Generator().manual_seed(0)
    width = engine.predictor.hidden.shape[1]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    x = torch.randn(256, width, generator=g).to("cuda:0", torch.bfloat16)
    ours, ref, noise = talker_logits(engine, x), hf_talker_logits(hf, x), hf_talker_logits(hf, x, "eager")
    hidden = torch.randn(8, width, generator=g).to("cuda:0", torch.bfloat16)
    code0 = torch.randint(0, 2048, (8,), generator=g).cuda()
    cp_ours, cp_ref = predictor_logits(engine, hidden, code0), hf_predictor_logits(hf, hidden, code0)
    cp_noise = hf_predictor_logits(hf, hidden, code0, "eager")
    print(f"talker logits, relative L2: ours against transformers {rel(ours, ref):.4f}, its eager against sdpa "
          f"{rel(noise, ref):.4f}; predictor {rel(cp_ours, cp_ref):.4f}, {rel(cp_noise, cp_ref):.4f}")
    assert rel(ours, ref) < max(2 * rel(noise, ref), 0.01)
    assert rel(cp_ours, cp_ref) < max(2 * rel(cp_noise, cp_ref), 0.01)
