"""The gateway counts a request's tokens from its media's headers before anything is decoded: the count equals the
preprocess's own after decoding wherever the header is exact, and a request past the context is refused on it."""

import io

import numpy as np
import pytest
from PIL import Image

from omni.stage.v1 import preprocess_pb2
from omni.v1 import omni_pb2
from references import png, video_file, wav

LIMITS = dict(max_audio_seconds=60, max_video_frames=64, max_request_bytes=64 << 20)


@pytest.fixture(scope="module")
def sides(tiny_model):
    """The header's count and the decode's, side by side: (preprocess, sizes, limits, prompt builder)."""
    from services.gateway.prompt import PromptBuilder
    from services.model.media_tokens import MediaSizes
    from services.model.spec import OmniSpec
    from services.preprocess.media import Preprocessor
    from services.runtime.config import Limits

    spec = OmniSpec.load(tiny_model)
    limits = Limits(**LIMITS)
    return Preprocessor(tiny_model, limits, spec.n_window), MediaSizes.load(tiny_model, spec.n_window), limits, \
        PromptBuilder(tiny_model, spec)


def counts(sides, part: omni_pb2.Part) -> tuple[list[tuple], list[tuple]]:
    """(tokens, grid and mel frames of the item and its soundtrack by the header, the same after the preprocess has
    decoded it)."""
    from services.gateway.validate import media_tokens
    from services.preprocess.server import prepare

    pre, sizes, limits, _ = sides
    kind = part.WhichOneof("content")
    media = getattr(part, kind)
    decoded = prepare(pre, 0, preprocess_pb2.MediaItem(**{kind: media}))
    return ([(m.num_tokens, m.grid_thw, m.feature_length) for m in media_tokens(media, sizes, limits)],
            [(f.num_tokens, f.grid_thw, f.feature_length) for f in decoded])


def image(width: int, height: int, fmt: str) -> omni_pb2.Part:
    return omni_pb2.Part(image=omni_pb2.Image(data=png(width * height, width, height, fmt)))


def pcm(seconds: float, rate: int, encoding: int, channels: int) -> omni_pb2.Part:
    samples = np.random.default_rng(1).uniform(-0.5, 0.5, (round(seconds * rate), channels))
    data = (samples * 32767).astype("<i2").tobytes() if encoding == omni_pb2.PCM_ENCODING_S16LE else samples.astype("<f4").tobytes()
    return omni_pb2.Part(audio=omni_pb2.Audio(pcm=omni_pb2.RawPcm(data=data, sample_rate=rate, encoding=encoding, channels=channels)))


IMAGES = [(64, 48, "PNG"), (32, 32, "PNG"), (56, 56, "JPEG"), (200, 100, "WEBP"), (333, 517, "PNG"), (1000, 31, "JPEG"),
          (1279, 719, "PNG"), (17, 900, "WEBP")]


@pytest.mark.parametrize("width,height,fmt", IMAGES)
def test_an_images_header_count_is_the_decoded_count(sides, width, height, fmt):
    header, decoded = counts(sides, image(width, height, fmt))
    assert header == decoded and decoded[0][0] > 0


@pytest.mark.parametrize("samples", [804, 8000, 16000, 16159, 21950, 32017, 63899, 116801, 240000, 499321])
def test_a_16khz_clips_header_count_is_the_decoded_count(sides, samples):
    seconds = samples / 16000
    header, decoded = counts(sides, omni_pb2.Part(audio=omni_pb2.Audio(file=wav(3, seconds))))
    assert header == decoded
    for encoding in (omni_pb2.PCM_ENCODING_S16LE, omni_pb2.PCM_ENCODING_F32LE):
        for channels in (1, 2):
            header, decoded = counts(sides, pcm(seconds, 16000, encoding, channels))
            assert header == decoded, (encoding, channels)


@pytest.mark.parametrize("rate", [8000, 11025, 22050, 44100, 48000])
def test_a_resampled_clip_is_counted_from_the_samples_ffmpeg_makes(sides, rate):
    """FFmpeg's resampler makes the header's samples times the rate ratio, or one more: the count is the decode's
    but where that one sample crosses a mel frame."""
    from services.preprocess import headers
    from services.preprocess.audio_in import decode_file

    _, sizes, _, _ = sides
    for seconds in (0.3, 1.0, 2.71, 6.0, 12.345):
        data = wav(4, seconds, rate)
        made = len(decode_file(data, 16000, 60, "audio"))
        said = headers.sound(omni_pb2.Audio(file=data), 16000).samples
        assert 0 <= made - said <= 1, (seconds, made, said)
        header, decoded = counts(sides, omni_pb2.Part(audio=omni_pb2.Audio(file=data)))
        assert header == [(sizes.sound_tokens(said), None, said // 160)]
        assert decoded == [(sizes.sound_tokens(made), None, made // 160)]


@pytest.mark.parametrize("rate", [11025, 22050, 24000, 32000, 44100, 48000, 96000])
def test_ffmpegs_resampler_makes_the_samples_counted_or_one_more(rate):
    """Over raw PCM of many lengths: never fewer (a count of them refuses nothing the decode would take)."""
    from services.preprocess import headers
    from services.preprocess.audio_in import resample

    made = []
    for n in np.random.default_rng(rate).integers(400, 400_000, 200):
        data = bytes(2 * int(n))
        said = headers.sound(omni_pb2.Audio(pcm=omni_pb2.RawPcm(data=data, sample_rate=rate, encoding=omni_pb2.PCM_ENCODING_S16LE)),
                             16000).samples
        made.append(len(resample(np.zeros(int(n), np.float32), rate, 16000)) - said)
    assert set(made) <= {0, 1}, sorted(set(made))


@pytest.mark.parametrize("count,width,height", [(1, 64, 48), (2, 64, 48), (3, 100, 100), (8, 32, 32), (5, 640, 360)])
def test_a_frame_lists_header_count_is_the_decoded_count(sides, count, width, height):
    frames = [omni_pb2.Image(data=png(i, width, height)) for i in range(count)]
    header, decoded = counts(sides, omni_pb2.Part(video=omni_pb2.Video(frames=frames, fps=2.0)))
    assert header == decoded


FILES = [  # (seconds, width, height, muxer, codec, frame rate, fps asked)
    (1.0, 64, 48, "mp4", "libx264", 25, 0.0), (2.3, 160, 120, "mp4", "libx264", 30, 0.0),
    (3.0, 96, 64, "mov", "libx264", 24, 0.0), (0.5, 64, 64, "mp4", "libx264", 10, 0.0),
    (6.0, 320, 240, "mp4", "libx264", 15, 1.0), (4.0, 64, 48, "mp4", "libx264", 25, 4.0),
    (2.3, 64, 48, "webm", "libvpx-vp9", 30, 0.0), (3.0, 160, 90, "matroska", "libx264", 24, 0.0),
]


@pytest.mark.parametrize("seconds,width,height,muxer,codec,rate,fps", FILES)
def test_a_video_files_header_count_is_the_decoded_count(sides, seconds, width, height, muxer, codec, rate, fps):
    data = video_file(seconds, width, height, muxer, codec, rate=rate)
    header, decoded = counts(sides, omni_pb2.Part(video=omni_pb2.Video(file=data, fps=fps)))
    assert header == decoded


@pytest.mark.parametrize("muxer,codec,sound", [("mp4", "libx264", "aac"), ("webm", "libvpx-vp9", "libopus"),
                                               ("matroska", "libx264", "aac")])
def test_a_video_heard_is_counted_frames_exactly_and_its_soundtrack_from_its_duration(sides, muxer, codec, sound):
    """A soundtrack's header states a duration, not samples (the encoder's priming and padding are a few ms): its
    tokens are within one of the decode's, the frames' exactly."""
    for seconds in (0.5, 1.0, 2.3, 4.0):
        data = video_file(seconds, 64, 48, muxer, codec, sound, rate=25)
        header, decoded = counts(sides, omni_pb2.Part(video=omni_pb2.Video(file=data, use_audio_in_video=True)))
        assert header[0] == decoded[0] and abs(header[1][0] - decoded[1][0]) <= 1, (seconds, header, decoded)


def test_a_whole_prompts_header_count_is_its_decoded_length(sides):
    """Text, an image, a clip, frames and a video heard, in two messages: the length counted from headers is the
    length of the prompt built from the decoded items."""
    from services.gateway.prompt import MediaRef
    from services.gateway.validate import media_tokens
    from services.preprocess.server import prepare

    pre, sizes, limits, prompts = sides
    parts = [image(200, 100, "PNG"), omni_pb2.Part(text="what is this?"), omni_pb2.Part(audio=omni_pb2.Audio(file=wav(5, 2.0))),
             omni_pb2.Part(video=omni_pb2.Video(frames=[omni_pb2.Image(data=png(i, 64, 48)) for i in range(4)])),
             omni_pb2.Part(video=omni_pb2.Video(file=video_file(2.0, 64, 48, sound="aac", rate=25), use_audio_in_video=True))]
    messages = [{"role": "user", "content": [{"type": p.WhichOneof("content"), **({"text": p.text} if p.text else {})}
                                             for p in parts]},
                {"role": "assistant", "content": [{"type": "text", "text": "a test"}]},
                {"role": "user", "content": [{"type": "text", "text": "and now?"}]}]
    ids = prompts.template(messages)
    media = [getattr(p, p.WhichOneof("content")) for p in parts if not p.text]
    header = [ref for m in media for ref in media_tokens(m, sizes, limits)]
    decoded = [MediaRef(f.kind, f.num_tokens, f.grid_thw, f.feature_length, f.second_per_grid, f.with_audio)
               for i, m in enumerate(media)
               for f in prepare(pre, i, preprocess_pb2.MediaItem(**{type(m).__name__.lower(): m}))]
    assert [m.num_tokens for m in header] == [m.num_tokens for m in decoded]
    assert prompts.length(ids, header) == len(prompts.build(ids, decoded).ids)


def test_unreadable_or_over_limit_items_count_nothing(sides):
    """Left to the preprocess, which refuses each from its header in its own words."""
    from services.gateway.validate import media_tokens

    _, sizes, limits, _ = sides
    big = io.BytesIO()
    Image.new("L", (5000, 5000)).save(big, format="PNG")
    items = [omni_pb2.Image(data=b"not an image"), omni_pb2.Image(data=big.getvalue()), omni_pb2.Image(data=png(1, 400, 1)),
             omni_pb2.Audio(file=b"RIFF" + bytes(300)), omni_pb2.Audio(file=wav(1, 61.0)),
             omni_pb2.Audio(pcm=omni_pb2.RawPcm(data=bytes(32000), sample_rate=16000)),
             omni_pb2.Video(frames=[omni_pb2.Image(data=png(1, 32, 32))] * 65), omni_pb2.Video(file=b"\x00" * 1000)]
    assert [m.num_tokens for item in items for m in media_tokens(item, sizes, limits)] == [0] * len(items)


def test_a_request_past_the_context_is_refused_before_the_preprocess_is_called(mesh):
    """Items that fit alone, past the context together (an image and a clip; a video heard and an image): refused
    with the count and the context, and the preprocess stage is never called for them, while requests with media
    interleaved among them are served whole."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from bad_requests import INVALID, media_past_the_context, user
    from client_util import error_of, generate, metric

    heard = user(("video_sound", video_file(2.0, 160, 120, sound="aac")), ("image", png(3, 640, 512)), ("text", "and?")).request()
    good = user(("image", png(9)), ("text", "ok")).request(max_tokens=4)
    expected = generate(mesh.gateway_address, good).token_ids
    port = mesh.cfg.preprocess.replicas[0].metrics_port
    before = metric(port, "omni_requests_total", method="Process")

    def run(req):
        t0 = time.perf_counter()
        out = generate(mesh.gateway_address, req) if req is good else error_of(mesh.gateway_address, req)
        return out, time.perf_counter() - t0

    jobs = [media_past_the_context(), good, heard, good] * 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, jobs))
    for req, (out, seconds) in zip(jobs, results):
        if req is good:
            assert out.token_ids == expected
            continue
        assert out is not None and out.code() == INVALID, out
        assert "counted from their headers" in out.details() and "past the context of 512" in out.details(), out.details()
        assert seconds < 1.0, seconds  # waits on no stage
    served = sum(1 for req in jobs if req is good)
    assert metric(port, "omni_requests_total", method="Process") - before == served, "the preprocess was called for a refused one"
