"""The whole mesh, as real processes over real sockets, against transformers' generate() on the same checkpoint."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from client_util import generate
from omni.v1 import omni_pb2, omni_pb2_grpc
from references import Case, Reference, garbled_sound, png, video_file, wav

# Waveform tolerance where every chunk had its full left context: float32 rounding plus PCM16 quantisation.
WAVE_ATOL = 5e-4

CASES = {
    "text": Case([("user", [("text", "Tell me a story about a cat.")])]),
    "image": Case([("user", [("image", png(1)), ("text", "What is in this picture?")])]),
    "audio": Case([("user", [("audio", wav(2, 1.5)), ("text", "What do you hear?")])]),
    "video": Case([("user", [("video", ([png(10 + i, 64, 64) for i in range(3)], 2.0)), ("text", "What happens?")])]),
    "video file": Case([("user", [("video_file", video_file(2, 64, 48, sound="aac")), ("text", "What happens?")])]),
    # the same file heard too (use_audio_in_video): its sound's tokens between its frames'
    "video sound": Case([("user", [("video_sound", video_file(2, 64, 48, sound="aac")), ("text", "What happens?")])]),
    "video sound mixed": Case([("user", [("image", png(5, 64, 48)), ("video_sound", video_file(2, 64, 48, sound="aac", seed=1)),
                                         ("audio", wav(6, 1.0)), ("text", "Compare them.")])]),
    "mixed": Case([
        ("system", [("text", "You are terse.")]),
        ("user", [("text", "Look:"), ("image", png(3, 96, 64)), ("audio", wav(4, 1.0)), ("text", "and compare.")]),
    ]),
}
# (case, speech): t2t, i2t, s2t, video (frames, a file, a file with its sound) in; t2s, i2s, s2s, a video file
# unheard and heard to speech; everything at once, and a video heard beside an image and a clip.
PATHS = {
    "t2t": ("text", False), "i2t": ("image", False), "s2t": ("audio", False), "v2t": ("video", False), "vf2t": ("video file", False),
    "vs2t": ("video sound", False), "t2s": ("text", True), "i2s": ("image", True), "s2s": ("audio", True),
    "vf2s": ("video file", True), "vs2s": ("video sound", True), "mixed2s": ("mixed", True),
    "vsmixed2s": ("video sound mixed", True),
}


@pytest.fixture(scope="module")
def reference(tiny_model, hf_model):
    return Reference(tiny_model, hf_model)


def check_waveform(result, ref_wave: np.ndarray, atol: float = WAVE_ATOL) -> None:
    """Each streamed chunk against the same samples of the reference decode, the chunks joined without a gap."""
    frame, sample = 0, 0
    for pcm, codes in zip(result.pcm, result.chunk_codes):
        ref = ref_wave[sample:sample + len(pcm)]
        assert len(ref) == len(pcm), f"chunk at frame {frame}: {len(pcm)} samples, reference has {len(ref)}"
        err = np.abs(pcm - ref).max()
        assert err < atol, f"chunk at frame {frame}: max abs error {err:.2e}"
        frame, sample = frame + len(codes), sample + len(pcm)
    assert frame == len(result.codes) and sample == len(ref_wave)


def check_waits(usage, case) -> None:
    """Where a time to first token waits: the thinker's queue; with media, the encoder's queue and each call as
    the gateway saw it (no shorter than the stage's own count, all within the time to first token)."""
    t = {x.stage: x.seconds for x in usage.timings}
    assert 0 < t["thinker_wait"] < usage.time_to_first_token_seconds, t
    if any(kind != "text" for _, parts in case.messages for kind, _ in parts):
        assert 0 < t["encode_wait"] and t["encode"] + t["encode_wait"] <= t["gateway_encode"], t
        assert t["preprocess"] <= t["gateway_preprocess"], t
        assert t["gateway_preprocess"] + t["gateway_encode"] < usage.time_to_first_token_seconds, t
    else:
        assert not {"encode_wait", "gateway_encode", "gateway_preprocess"} & set(t), t


@pytest.mark.parametrize("path", list(PATHS))
def test_path_matches_transformers(any_mesh, reference, path):
    mesh = any_mesh
    case_name, speech = PATHS[path]
    case = CASES[case_name]
    ids, codes, wave = reference.generate(case, max_tokens=10, speech=speech, frames=14)
    res = generate(mesh.gateway_address, case.request(speech=speech, max_tokens=10, frames=14))
    assert res.token_ids == ids
    assert res.text == reference.tokenizer.decode(ids, skip_special_tokens=True)
    usage = res.finished.usage
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens > 0
    assert res.finished.reason in (omni_pb2.FINISH_REASON_STOP, omni_pb2.FINISH_REASON_LENGTH)
    if not speech:
        assert res.pcm == [] and usage.audio_seconds == 0
        check_waits(usage, case)
        return
    assert res.codes == codes and len(codes) > 0
    assert usage.audio_frames == len(codes)
    assert usage.audio_seconds == pytest.approx(res.samples / 24000)
    assert 0 < usage.time_to_first_token_seconds <= usage.time_to_first_audio_seconds
    check_waits(usage, case)
    # The talker's share of the time to first audio, step by step, within it.
    split = {t.stage: t.seconds for t in usage.timings if t.stage.startswith("talker_")}
    assert {"talker_queue", "talker_first_frame", "talker_first_chunk"} <= set(split), split
    assert all(v >= 0 for v in split.values()) and sum(split.values()) < usage.time_to_first_audio_seconds
    check_waveform(res, wave)
    assert res.events.index("audio") < len(res.events) - 1 and res.events[-1] == "finished"


# A file in each container the API lists, with a soundtrack, heard: its frames and its sound through every stage.
CONTAINERS = {"mp4 h264 aac": ("mp4", "libx264", "aac"), "mov h264 aac": ("mov", "libx264", "aac"),
              "mkv av1 opus": ("matroska", "libsvtav1", "libopus"), "webm vp9 opus": ("webm", "libvpx-vp9", "libopus"),
              "webm av1 opus": ("webm", "libsvtav1", "libopus")}


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_every_container_is_heard_end_to_end(native_mesh, reference, name):
    muxer, codec, sound = CONTAINERS[name]
    case = Case([("user", [("video_sound", video_file(2, 64, 48, muxer, codec, sound, seed=3)), ("text", "What happens?")])])
    ids, _, _ = reference.generate(case, max_tokens=8)
    res = generate(native_mesh.gateway_address, case.request(max_tokens=8))
    assert res.token_ids == ids
    assert res.finished.usage.prompt_tokens == reference.inputs(case)["input_ids"].shape[1]


def test_a_soundtrack_not_heard_is_not_read_end_to_end(native_mesh, reference):
    """A file whose audio no decoder reads is served unheard as the good file is (tests/bad_requests.py has it
    refused when heard)."""
    good = video_file(2, 64, 48, sound="aac", seed=4)
    bad = Case([("user", [("video_file", garbled_sound(good, "mp4")), ("text", "What happens?")])])
    ids, _, _ = reference.generate(Case([("user", [("video_file", good), ("text", "What happens?")])]), max_tokens=8)
    assert generate(native_mesh.gateway_address, bad.request(max_tokens=8)).token_ids == ids


def test_long_speech_is_chunked_with_left_context(mesh, reference):
    """40 frames in chunks of 8, each decoded after at most 25 frames of left context: every chunk's samples are
    transformers' code2wav's on the same frames and context (what its chunked_decode does at its own chunk size;
    the reference's one decode of all 40 frames is the same only where a chunk has all frames before it)."""
    import torch

    from services.talker.chunks import decoded_tail

    case = CASES["image"]
    ids, codes, wave = reference.generate(case, max_tokens=30, speech=True, frames=40)
    res = generate(mesh.gateway_address, case.request(speech=True, max_tokens=30, frames=40))
    assert res.token_ids == ids and res.codes == codes
    code2wav, frames = reference.hf.code2wav, torch.tensor(codes).T[None]  # [1, groups, frames]
    tail = decoded_tail(code2wav)  # the samples at the end of a decode that read the frame after: the next chunk's
    frame, sample = 0, 0
    for pcm, chunk in zip(res.pcm, res.chunk_codes):
        context = min(25, frame)
        kept = context * code2wav.total_upsample - (tail if context else 0)
        with torch.no_grad():
            ref = code2wav(frames[..., frame - context:frame + len(chunk)])[..., kept:]
        ref = ref.reshape(-1).float().numpy()
        assert len(pcm) == len(ref), frame
        rel = np.sqrt(np.mean((pcm - ref) ** 2) / np.mean(ref ** 2))
        assert rel < 1e-3, f"chunk at frame {frame}: relative RMS error {rel:.2e}"
        if frame + len(chunk) <= 25:  # all frames before it in its context: the whole decode's samples too
            whole = wave[sample:sample + len(pcm)]
            assert np.sqrt(np.mean((pcm - whole) ** 2) / np.mean(whole ** 2)) < 1e-3, frame
        frame, sample = frame + len(chunk), sample + len(pcm)
    assert frame == 40 and len(res.pcm) > 4  # chunks past the left context were checked
    assert sample == len(wave)  # joined without a gap: as many samples as one decode of the 40 frames


def test_speech_starts_before_the_text_ends(mesh):
    """The talker takes the thinker's states as they come: the first audio arrives among the text deltas."""
    req = CASES["text"].request(speech=True, max_tokens=250, frames=8)
    req.sampling.ignore_eos = True
    res = generate(mesh.gateway_address, req)
    first_audio, last_text = res.events.index("audio"), len(res.events) - 1 - res.events[::-1].index("text")
    assert first_audio < last_text - 50, (first_audio, last_text)


def test_wav_output_and_voices(mesh):
    """WAV output: one file at the end holding the samples the same request streams as PCM chunks (a voice named
    in any case)."""
    import io
    import wave as wavmod

    req = CASES["text"].request(speech=True, max_tokens=6, frames=8, voice="Chelsie", codes=False)
    req.talker_sampling.ignore_eos = True  # all 8 frames: two chunks of 4 (conftest's talker chunks)
    streamed = generate(mesh.gateway_address, req)
    req.audio_format = omni_pb2.AUDIO_FORMAT_WAV
    with grpc.insecure_channel(mesh.gateway_address) as ch:
        audio = [r.audio for r in omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=60) if r.HasField("audio")]
    assert len(audio) == 1 and audio[0].format == omni_pb2.AUDIO_FORMAT_WAV
    with wavmod.open(io.BytesIO(audio[0].data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767.0
    assert len(streamed.pcm) == 2 and np.array_equal(samples, np.concatenate(streamed.pcm))


def test_concurrent_mixed_requests(any_mesh, reference):
    mesh = any_mesh
    jobs = [(name, *PATHS[name]) for name in ["t2t", "i2s", "s2t", "t2s", "i2t", "s2s", "mixed2s", "v2t"] * 2]
    expected = {name: reference.generate(CASES[case], max_tokens=8, speech=speech, frames=10) for name, case, speech in jobs}
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: generate(mesh.gateway_address, CASES[j[1]].request(j[2], 8, 10)), jobs))
    for (name, _, speech), res in zip(jobs, results):
        ids, codes, _ = expected[name]
        assert res.token_ids == ids, name
        if speech:
            assert res.codes == codes, name


def test_sampling_is_seeded(mesh):
    req = CASES["text"].request(speech=True, max_tokens=12, frames=10, greedy=False)
    req.sampling.seed, req.talker_sampling.seed = 7, 9
    a, b = generate(mesh.gateway_address, req), generate(mesh.gateway_address, req)
    assert a.token_ids == b.token_ids and a.codes == b.codes
    req.sampling.seed = 8
    assert generate(mesh.gateway_address, req).token_ids != a.token_ids


def test_stop_strings_and_fixed_length(mesh, reference):
    case = CASES["text"]
    full = generate(mesh.gateway_address, case.request(max_tokens=20))
    assert len(full.text) > 4
    stop = full.text[2:4]
    req = case.request(max_tokens=20)
    req.sampling.stop.append(stop)
    res = generate(mesh.gateway_address, req)
    assert res.finished.reason == omni_pb2.FINISH_REASON_STOP_STRING
    assert res.text == full.text[:full.text.find(stop)]
    req = case.request(max_tokens=17)
    req.sampling.ignore_eos = True
    res = generate(mesh.gateway_address, req)
    assert len(res.token_ids) == res.finished.usage.completion_tokens == 17
    assert res.finished.reason == omni_pb2.FINISH_REASON_LENGTH


def test_model_info(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as ch:
        info = omni_pb2_grpc.OmniStub(ch).GetModelInfo(omni_pb2.GetModelInfoRequest(), timeout=10)
    assert set(info.voices) == {"aiden", "chelsie", "ethan"} and info.default_voice == "ethan"
    assert omni_pb2.MODALITY_AUDIO in info.output_modalities and info.audio_sample_rate == 24000
    assert info.limits.max_media_items == 4


def test_every_stage_froze_what_it_built_before_serving(mesh):
    """Each stage process froze its heap (heap.freeze) before it said it was serving: the collector's full
    passes no longer walk the model it loaded (the talker stalled ~500 ms mid-step without it, session 18)."""
    import re

    for name, _, _ in mesh.processes():
        log = (mesh.log_dir / f"{name}.log").read_text()
        froze, serving = re.search(r"froze (\d+) objects built before serving", log), log.find("serving on")
        assert froze and int(froze[1]) > 10_000 and -1 < froze.start() < serving, f"{name}: {log[-2000:]}"


def test_health_and_reflection(mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for stage in mesh.cfg.STAGES:
        for r in mesh.cfg.replicas(stage):
            with grpc.insecure_channel(r.address) as ch:
                assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
                reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
                names = {s.name for s in reply.list_services_response.service}
                assert "grpc.health.v1.Health" in names and any(n.startswith("omni.") for n in names), names


def test_encodes_are_routed_by_output_modality(mesh):
    from client_util import metric

    ports = [r.metrics_port for r in mesh.cfg.encoder.replicas]
    before = [metric(p, "omni_requests_total", method="Encode") for p in ports]
    for speech in (False, True, False, True):
        generate(mesh.gateway_address, CASES["image"].request(speech=speech, max_tokens=2, frames=2))
    after = [metric(p, "omni_requests_total", method="Encode") for p in ports]
    # Replica 0 is preferred for text output, replica 1 for audio output (see conftest.write_config).
    assert [a - b for a, b in zip(after, before)] == [2, 2]


def test_every_stage_reports_its_load(any_mesh):
    """The Load service of each real stage process: the thinker counts a request while it streams."""
    import threading

    from omni.stage.v1 import load_pb2, load_pb2_grpc

    def report(stage: str, i: int = 0):
        with grpc.insecure_channel(any_mesh.cfg.replicas(stage)[i].address) as ch:
            return load_pb2_grpc.LoadStub(ch).Get(load_pb2.LoadRequest(), timeout=10)

    for stage in any_mesh.cfg.STAGES:
        for i in range(len(any_mesh.cfg.replicas(stage))):
            r = report(stage, i)
            assert (r.stage, r.replica) == (stage, i)
    idle = report("thinker")
    req = omni_pb2.GenerateRequest(messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=[omni_pb2.Part(text="Count.")])],
                                   sampling=omni_pb2.SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(report("thinker"))

    t = threading.Thread(target=watch)
    t.start()
    try:
        generate(any_mesh.gateway_address, req)
    finally:
        stop.set()
        t.join()
    assert idle.in_flight == 0 and idle.active == 0
    # the one request streaming, and nothing else (its own Load calls not counted)
    assert max(r.in_flight for r in seen) == 1 and max(r.active for r in seen) == 1


def test_queue_waits_reach_prometheus(mesh):
    """omni_queue_wait_seconds (the Grafana panel "Queue wait"): every engine stage a speech request with an
    image passes through observes its wait once per request."""
    from client_util import metric

    def counts():
        return {stage: sum(metric(r.metrics_port, "omni_queue_wait_seconds_count", stage=stage) for r in mesh.cfg.replicas(stage))
                for stage in ("encoder", "thinker", "talker")}

    before = counts()
    for _ in range(2):
        generate(mesh.gateway_address, CASES["image"].request(speech=True, max_tokens=2, frames=2))
    assert {s: c - before[s] for s, c in counts().items()} == {"encoder": 2, "thinker": 2, "talker": 2}
