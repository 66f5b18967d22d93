"""One request cannot hurt the others: each stage checks what it is sent (called directly too), a request whose
own part of an engine step fails fails alone, and limits are checked before the work they bound."""

import asyncio
import io
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from bad_requests import INVALID, float_wav, user
from client_util import error_of, generate
from omni.stage.v1 import common_pb2, talker_pb2, talker_pb2_grpc, tensor_pb2, thinker_pb2, thinker_pb2_grpc
from omni.v1 import omni_pb2

GOOD_TOKENS = 24


def _prompt(cfg) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(cfg.model.dir).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _vocabs(cfg) -> tuple[int, int]:
    from services.model.spec import OmniSpec

    spec = OmniSpec.load(cfg.model.dir)
    return spec.thinker["text_config"]["vocab_size"], spec.talker["text_config"]["vocab_size"]


def thinker_cases(cfg) -> dict:
    """name -> (ThinkerRequest, words its INVALID_ARGUMENT must say)."""
    ids, (vocab, _) = _prompt(cfg), _vocabs(cfg)
    context = cfg.limits.max_context_tokens

    def req(**sampling):
        r = thinker_pb2.ThinkerRequest(request_id="bad", prompt_ids=ids, sampling=common_pb2.Sampling(max_tokens=4))
        for k, v in sampling.items():
            getattr(r.sampling, k).extend(v) if k == "stop_token_ids" else setattr(r.sampling, k, v)
        return r

    def edit(r, **fields):
        for k, v in fields.items():
            getattr(r, k).extend(v) if isinstance(v, list) else setattr(r, k, v)
        return r

    from services.model.spec import OmniSpec

    hidden = OmniSpec.load(cfg.model.dir).thinker_hidden
    rows = tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[3, hidden], inline_data=bytes(12 * hidden))

    def runs(*pairs):  # three rows of embeddings laid over the prompt in runs
        return edit(req(), spans=[thinker_pb2.MultimodalSpan(embeds=rows, runs=list(pairs))])

    return {
        "temperature NaN": (req(temperature=math.nan), "sampling.temperature"),
        "temperature inf": (req(temperature=math.inf), "sampling.temperature"),
        "temperature negative": (req(temperature=-1.0), "sampling.temperature"),
        "top_p over 1": (req(top_p=1.5), "sampling.top_p"),
        "top_p NaN": (req(top_p=math.nan), "sampling.top_p"),
        "top_k negative": (req(top_k=-1), "sampling.top_k"),
        "penalty NaN": (req(repetition_penalty=math.nan), "sampling.repetition_penalty"),
        "penalty negative": (req(repetition_penalty=-2.0), "sampling.repetition_penalty"),
        "max_tokens 0": (req(max_tokens=0), "sampling.max_tokens"),
        "max_tokens 2^31 - 1": (req(max_tokens=2**31 - 1), "sampling.max_tokens"),
        "min_tokens over max": (req(min_tokens=10), "sampling.min_tokens"),
        "min_tokens negative": (req(min_tokens=-1), "sampling.min_tokens"),
        "stop id past the vocabulary": (req(min_tokens=2, stop_token_ids=[vocab + 5]), "sampling.stop_token_ids"),
        "stop id negative": (req(stop_token_ids=[-3]), "sampling.stop_token_ids"),
        "prompt id past the vocabulary": (edit(req(), prompt_ids=[vocab]), "prompt_ids must lie in"),
        "prompt id negative": (thinker_pb2.ThinkerRequest(prompt_ids=[-1, 3], sampling=common_pb2.Sampling(max_tokens=4)),
                               "prompt_ids must lie in"),
        "empty prompt": (thinker_pb2.ThinkerRequest(sampling=common_pb2.Sampling(max_tokens=4)), "prompt_ids is empty"),
        "prompt past the context": (thinker_pb2.ThinkerRequest(prompt_ids=[ids[0]] * (context + 1),
                                                               sampling=common_pb2.Sampling(max_tokens=1)), "past the context"),
        "positions of the wrong length": (edit(req(), positions=[0.0] * 5), "positions has 5 values"),
        "positions NaN": (edit(req(), positions=[math.nan] * (3 * len(ids))), "positions must be finite"),
        "rope_delta NaN": (edit(req(), rope_delta=math.nan), "rope_delta"),
        "embed_token_ids past the vocabulary": (edit(req(), embed_token_ids=[vocab + 1]), "embed_token_ids must lie in"),
        "span runs not pairs": (runs(0, 2, 3), "span runs must be (offset, rows) pairs"),
        "span run past the prompt": (runs(0, 1, len(ids) + 5, 2), "span runs must be (offset, rows) pairs within the prompt"),
        "span runs short of its rows": (runs(0, 1, 2, 1), "span runs cover 2 rows of 3"),
        "span run off the prompt's end": (runs(0, 1, len(ids) - 1, 2), "does not fit a prompt"),
    }


def talker_cases(cfg) -> dict:
    """name -> (TalkerStart, words its INVALID_ARGUMENT must say)."""
    ids, (vocab, codec_vocab) = _prompt(cfg), _vocabs(cfg)

    def start(prompt=ids, **sampling):
        s = talker_pb2.TalkerStart(request_id="bad", prompt_ids=prompt, sampling=common_pb2.Sampling(max_tokens=4))
        for k, v in sampling.items():
            getattr(s.sampling, k).extend(v) if k == "stop_token_ids" else setattr(s.sampling, k, v)
        return s

    def with_layout(**fields):
        s = start()
        for k, v in fields.items():
            getattr(s.layout, k).extend(v)
        return s

    return {
        "unknown voice": (talker_pb2.TalkerStart(prompt_ids=ids, voice="nobody", sampling=common_pb2.Sampling(max_tokens=4)),
                          "unknown voice nobody"),
        "empty prompt": (start(prompt=[]), "prompt_ids is empty"),
        "prompt id past the vocabulary": (start(prompt=ids + [vocab]), "prompt_ids must lie in"),
        "prompt past the context": (start(prompt=[ids[0]] * (cfg.limits.max_context_tokens + 1)), "past the context"),
        "temperature NaN": (start(temperature=math.nan), "sampling.temperature"),
        "top_p NaN": (start(top_p=math.nan), "sampling.top_p"),
        "top_k negative": (start(top_k=-1), "sampling.top_k"),
        "penalty inf": (start(repetition_penalty=math.inf), "sampling.repetition_penalty"),
        "frames over the limit": (start(max_tokens=cfg.limits.max_talker_frames + 1), "sampling.max_tokens"),
        "min frames over max": (start(min_tokens=9), "sampling.min_tokens"),
        "stop id past the codec vocabulary": (start(min_tokens=2, stop_token_ids=[codec_vocab]), "sampling.stop_token_ids"),
        "audio feature length negative": (with_layout(audio_feature_lengths=[-4]), "audio_feature_lengths"),
        "image grid not triples": (with_layout(image_grid_thw=[1, 2]), "image_grid_thw"),
        "image grid past the context": (with_layout(image_grid_thw=[1, 4000, 4000]), "image_grid_thw"),
        "tts_embeds of the wrong shape": (talker_pb2.TalkerStart(
            prompt_ids=ids, sampling=common_pb2.Sampling(max_tokens=4),
            tts_embeds=tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[3, 5], inline_data=bytes(60))),
            "tts_embeds of shape [3, 5]"),
    }


def _thinker_error(address: str, req) -> grpc.RpcError | None:
    with grpc.insecure_channel(address) as ch:
        try:
            list(thinker_pb2_grpc.ThinkerStub(ch).Generate(req, timeout=30))
        except grpc.RpcError as e:
            return e
    return None


def _talker_error(address: str, start) -> grpc.RpcError | None:
    with grpc.insecure_channel(address) as ch:
        try:
            list(talker_pb2_grpc.TalkerStub(ch).Synthesize(iter([talker_pb2.TalkerInput(start=start)]), timeout=30))
        except grpc.RpcError as e:
            return e
    return None


def _good(speech: bool) -> omni_pb2.GenerateRequest:
    req = user(("text", "tell me more")).request(speech=speech, max_tokens=GOOD_TOKENS, frames=GOOD_TOKENS)
    req.sampling.ignore_eos = req.talker_sampling.ignore_eos = True
    return req


def test_stages_called_directly_refuse_every_bad_parameter_while_good_requests_share_the_engines(native_mesh):
    cfg = native_mesh.cfg
    gateway, thinker, talker = native_mesh.gateway_address, cfg.thinker.replicas[0].address, cfg.talker.replicas[0].address
    expected = {s: generate(gateway, _good(s)) for s in (False, True)}
    direct = thinker_pb2.ThinkerRequest(request_id="ok", prompt_ids=_prompt(cfg), sampling=common_pb2.Sampling(max_tokens=4))
    with grpc.insecure_channel(thinker) as ch:  # the cases' base request is itself served
        assert sum(len(o.token_ids) for o in thinker_pb2_grpc.ThinkerStub(ch).Generate(direct, timeout=60)) == 4
    bad = [("thinker", name, r, words) for name, (r, words) in thinker_cases(cfg).items()]
    bad += [("talker", name, s, words) for name, (s, words) in talker_cases(cfg).items()]

    def run_bad(job):
        stage, name, msg, words = job
        time.sleep(0.2)  # the good requests are in their engines by now
        return job, (_thinker_error(thinker, msg) if stage == "thinker" else _talker_error(talker, msg))

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(generate, gateway, _good(s)) for s in (False, True, False)]
        results = list(pool.map(run_bad, bad))
        for s, g in zip((False, True, False), goods):
            out = g.result()
            assert out.token_ids == expected[s].token_ids and out.codes == expected[s].codes, "a good request changed"
            assert len(out.token_ids) == GOOD_TOKENS and len(out.codes) == (GOOD_TOKENS if s else 0)
    for (stage, name, _, words), err in results:
        assert err is not None, f"{stage}, {name}: accepted"
        assert err.code() == INVALID, f"{stage}, {name}: {err.code()} {err.details()}"
        assert words in err.details(), f"{stage}, {name}: {err.details()} does not say {words}"
        assert "'" not in err.details() and "Error" not in err.details(), f"{stage}, {name}: {err.details()}"


def test_a_tensor_ref_naming_a_foreign_shm_file_is_refused_and_the_file_left_alone(native_mesh):
    cfg = native_mesh.cfg
    path = f"/dev/shm/foreign-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(b"\x07" * (1 << 20))
    try:
        for pool in (os.path.basename(path), f"../shm/{os.path.basename(path)}", "omni-thinker0-1"):
            hidden = 8
            ref = tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1, hidden],
                                       shm=tensor_pb2.ShmSlot(pool=pool, slot=0, generation=0, offset=0, nbytes=4 * hidden))
            req = thinker_pb2.ThinkerRequest(request_id="ref", prompt_ids=_prompt(cfg), sampling=common_pb2.Sampling(max_tokens=2),
                                             spans=[thinker_pb2.MultimodalSpan(offset=0, embeds=ref)])
            err = _thinker_error(cfg.thinker.replicas[0].address, req)
            assert err is not None and err.code() == INVALID, (pool, err)
            assert "not a tensor pool of this mesh" in err.details() or "does not exist" in err.details(), err.details()
        with open(path, "rb") as f:
            assert f.read() == b"\x07" * (1 << 20)
    finally:
        os.unlink(path)


def test_nan_audio_and_unknown_modalities_are_refused_by_name(native_mesh):
    gateway = native_mesh.gateway_address
    samples = (0.1 * np.sin(np.arange(16000) / 7)).astype(np.float32)
    assert generate(gateway, user(("audio", float_wav(samples)), ("text", "x")).request(max_tokens=2)).finished is not None
    samples[4000] = np.nan
    for greedy in (True, False):
        err = error_of(gateway, user(("text", "x"), ("audio", float_wav(samples))).request(max_tokens=2, greedy=greedy))
        assert err is not None and err.code() == INVALID and "media item 0: audio samples contain NaN" in err.details(), err
    req = user(("text", "x")).request()
    req.output_modalities.append(7)
    err = error_of(gateway, req)
    assert err is not None and err.code() == INVALID and "unknown modality 7" in err.details(), err


def _rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_oversize_text_is_refused_before_it_is_tokenised(native_mesh):
    pid = native_mesh.procs["gateway-0"].pid
    before = _rss_kb(pid, "VmHWM")
    text = "word " * ((native_mesh.cfg.limits.max_request_bytes - (64 << 10)) // 5)  # just under the message limit
    t0 = time.monotonic()
    err = error_of(native_mesh.gateway_address, user(("text", text)).request(), timeout=60)
    elapsed = time.monotonic() - t0
    assert err is not None and err.code() == INVALID and "characters, more than a context of" in err.details(), err
    assert elapsed < 10, elapsed  # tokenising it took far longer, and held the event loop
    assert _rss_kb(pid, "VmHWM") - before < 200 << 10, "the gateway's peak memory jumped"
    assert generate(native_mesh.gateway_address, user(("text", "still there")).request(max_tokens=2)).finished is not None


# -- in process: the preprocessor and an engine on its worker ------------------------------------------


@pytest.fixture(scope="module")
def preprocessor(tiny_model):
    from services.preprocess.media import Preprocessor
    from services.runtime.config import Limits

    return Preprocessor(tiny_model, Limits(max_audio_seconds=600), 50, context=512)


def test_sixteen_bit_grey_pngs_are_scaled_not_clipped(preprocessor):
    grey = np.random.default_rng(0).integers(0, 200, (48, 64), dtype=np.uint16)  # clipped, all but 0 read 255

    def encoded(arr):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        return buf.getvalue()

    deep = encoded(grey * 257)
    assert Image.open(io.BytesIO(deep)).mode.startswith("I")
    eight = preprocessor.image(encoded(grey.astype(np.uint8)))
    sixteen = preprocessor.image(deep)
    assert np.array_equal(sixteen.values, eight.values) and (sixteen.values == 255).mean() < 0.1


def test_audio_past_the_context_is_refused_from_its_header(preprocessor):
    from services.preprocess.audio_in import decode_file
    from services.runtime.errors import InvalidArgument

    calls = []

    def check(seconds, where):  # what decode_file asks before it decodes a sample
        calls.append(seconds)
        preprocessor._check_context(seconds, where)

    long = float_wav(np.zeros(60 * 16000, np.float32))
    with pytest.raises(InvalidArgument, match=r"60.0 s of audio makes more tokens than the context of 512"):
        preprocessor.audio_file(long, "media item 0")
    with pytest.raises(InvalidArgument, match="context of 512"):
        decode_file(long, 16000, 600, "media item 0", check)
    assert calls == [60.0]  # from the header: the decoded samples were never counted
    with pytest.raises(InvalidArgument, match="context of 512"):  # raw PCM: from its byte count
        preprocessor.audio_pcm(bytes(2 * 16000 * 45), 16000, "s16le", 1, "media item 0")


def test_a_request_whose_own_inputs_fail_in_a_step_fails_alone(tiny_model):
    from references import native_thinker
    from services.llm.sampling import SamplingParams
    from services.runtime.worker import EngineWorker
    from services.thinker.seq import Span, ThinkerSeq

    engine = native_thinker(tiny_model, block_size=8, max_batched_tokens=64, kv_blocks=64)
    rng = torch.Generator().manual_seed(0)

    def seqs():
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        return [ThinkerSeq(f"good{i}", torch.randint(0, engine.vocab, (12 + i,), generator=rng.manual_seed(i)), params)
                for i in range(3)]

    def unreadable():  # passes every check at admission, fails when its step copies the embeddings in
        return ThinkerSeq("bad", torch.randint(0, engine.vocab, (12,), generator=rng.manual_seed(9)),
                          SamplingParams(max_tokens=6), spans=[Span(2, torch.empty(3, engine.hidden_size, device="meta"))])

    async def serve(reqs):
        worker = EngineWorker(engine, "thinker")

        async def tokens(h):
            try:
                return [t async for step in h.outputs() for t in step.token_ids]
            except Exception as exc:  # noqa: BLE001
                return exc

        try:
            handles = [worker.submit(r) for r in reqs]
            return await asyncio.gather(*(tokens(h) for h in handles))
        finally:
            worker.stop()

    alone = asyncio.run(serve(seqs()))
    together = asyncio.run(serve([unreadable(), *seqs()]))
    assert isinstance(together[0], NotImplementedError), together[0]
    assert together[1:] == alone and all(len(t) == 6 for t in alone)
    assert engine.scheduler.allocator.used == 0


def test_thinker_states_of_the_wrong_width_fail_their_request_alone(native_mesh):
    from services.model.spec import OmniSpec
    from services.runtime.config import TransportConfig
    from services.runtime.transport import Transport

    cfg = native_mesh.cfg
    hidden = OmniSpec.load(cfg.model.dir).thinker_hidden
    inline = Transport(TransportConfig(shm=False), "test")
    start = talker_pb2.TalkerStart(request_id="wide", prompt_ids=_prompt(cfg), tts_embeds=inline.put(torch.zeros(3, hidden), None),
                                   sampling=common_pb2.Sampling(max_tokens=4))
    wide = inline.put(torch.zeros(2, 2, hidden + 1), None)
    messages = [talker_pb2.TalkerInput(start=start), talker_pb2.TalkerInput(states=talker_pb2.ThinkerStates(start=0, states=wide)),
                talker_pb2.TalkerInput(end=talker_pb2.TextEnd())]
    with grpc.insecure_channel(cfg.talker.replicas[0].address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(talker_pb2_grpc.TalkerStub(ch).Synthesize(iter(messages), timeout=30))
    assert e.value.code() == INVALID and f"thinker states of shape [2, 2, {hidden + 1}]" in e.value.details()
    out = generate(native_mesh.gateway_address, _good(True))
    assert len(out.codes) == GOOD_TOKENS


def test_an_image_past_the_context_is_refused_from_its_header(preprocessor):
    from services.runtime.errors import InvalidArgument

    buf = io.BytesIO()
    Image.new("RGB", (1024, 1024)).save(buf, format="PNG")
    with pytest.raises(InvalidArgument, match=r"1024x1024 makes \d+ tokens, more than the context of 512"):
        preprocessor.image(buf.getvalue(), "media item 0")
    head = buf.getvalue()[:100]  # the header alone: refused before the pixels are read
    with pytest.raises(InvalidArgument, match="more than the context of 512"):
        preprocessor.image(head, "media item 0")


def test_error_texts_carry_no_python_reprs(native_mesh):
    from bad_requests import bad_requests

    cases = bad_requests()
    for name in ("corrupt image", "truncated image", "corrupt audio", "truncated audio", "reserved token in text",
                 "unknown voice", "garbled soundtrack heard"):
        err = error_of(native_mesh.gateway_address, cases[name][0])
        assert err is not None and err.code() == cases[name][1], name
        for repr_mark in ("object at 0x", "[Errno", "'", "Error:"):
            assert repr_mark not in err.details(), f"{name}: {err.details()}"


def test_damaged_video_files_are_refused_and_the_preprocess_stage_keeps_serving(native_mesh):
    """Bytes of a good MP4 and WebM overwritten at random places: each refused as INVALID_ARGUMENT (or, where the damage
    misses what the decoder reads, served), never a crash or a hang; a good file is served after them."""
    from references import video_file

    good = {m: video_file(1, 64, 48, m, c, sound=a) for m, c, a in (("mp4", "libx264", "aac"), ("webm", "libvpx-vp9", "libopus"))}
    rng = np.random.default_rng(0)
    damaged = []
    for data in good.values():
        for _ in range(6):
            b = bytearray(data)
            at = int(rng.integers(0, len(b) - 64))
            b[at:at + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
            damaged.append(bytes(b))
    with ThreadPoolExecutor(4) as pool:
        errors = list(pool.map(lambda d: error_of(native_mesh.gateway_address, user(("video_file", d), ("text", "x")).request(max_tokens=2), timeout=60), damaged))
    for err in errors:
        assert err is None or (err.code() == INVALID and "media item 0: " in err.details()), err
    ok = generate(native_mesh.gateway_address, user(("video_file", good["mp4"]), ("text", "x")).request(max_tokens=2))
    assert len(ok.token_ids) > 0
