"""Video files in, through PyAV (services/preprocess/video_in.py): the frames Qwen's video processor samples, resized
and patched to transformers' pixels; the soundtrack at 16 kHz mono, the samples the same file gives as audio; every
limit and every bad file refused by item, before the file is decoded."""

import ast
import io
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from PIL import Image

from api.test_audio_in import transcode
from references import garbled_sound, video_file, wav
from services.preprocess.audio_in import decode_file
from services.preprocess.media import PixelNorm, Preprocessor
from services.preprocess.video_in import decode_video, sample_indices, sample_times
from services.runtime.config import Limits
from services.runtime.errors import InvalidArgument, ResourceExhausted

# (muxer, video encoder, audio encoder or "") of each clip: 2 s of 160x120 at 25 fps.
CLIPS = {"mp4 h264": ("mp4", "libx264", ""), "mp4 h264 aac": ("mp4", "libx264", "aac"),
         "webm vp9": ("webm", "libvpx-vp9", ""), "webm vp9 opus": ("webm", "libvpx-vp9", "libopus"),
         "mkv av1": ("matroska", "libsvtav1", ""), "mov h264 aac": ("mov", "libx264", "aac"),
         "webm av1 opus": ("webm", "libsvtav1", "libopus"), "mp4 av1 aac": ("mp4", "libsvtav1", "aac"),
         "mkv h264 aac": ("matroska", "libx264", "aac"), "mp4 hevc aac": ("mp4", "libx265", "aac"),
         "webm vp8 opus": ("webm", "libvpx", "libopus")}
# Both sides resize the same uint8 frames with PIL's bicubic filter, then rescale and normalise in float32.
PIXEL_ATOL = 1e-6


def transformers_sample_frames():
    """Qwen2VLVideoProcessor.sample_frames and its class defaults, compiled from transformers' own file: the module
    imports torchvision, which the services do not need."""
    import transformers
    from transformers.video_utils import VideoMetadata

    path = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    defaults = {a.targets[0].id: ast.literal_eval(a.value) for a in cls.body if isinstance(a, ast.Assign)
                and a.targets[0].id in ("temporal_patch_size", "min_frames", "max_frames")}
    ns = {"math": math, "torch": torch, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    owner = SimpleNamespace(num_frames=None, fps=None, **defaults)
    return lambda total, video_fps, fps: ns["sample_frames"](owner, VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps)


def reference_pixels(model_dir, data: bytes, fps: float = 2.0) -> np.ndarray:
    """Every frame decoded, sampled by transformers' sample_frames, each made pixels by transformers' image processor at
    Qwen3-Omni's video sizes: [frames, patches, C, P*P] float32."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessorKwargs

    with av.open(io.BytesIO(data)) as c:
        rate = float(c.streams.video[0].average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    keep = transformers_sample_frames()(len(frames), rate, fps)
    ip = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    size = Qwen3OmniMoeProcessorKwargs._defaults["videos_kwargs"]["size"]
    out = ip(images=[Image.fromarray(frames[i]) for i in keep], size=size, return_tensors="np")["pixel_values"]
    c, t, p = 3, ip.temporal_patch_size, ip.patch_size
    return out.reshape(len(keep), -1, c, t, p * p)[:, :, :, 0]  # one image is its frame repeated t times


@pytest.fixture(scope="module")
def pre(tiny_model) -> Preprocessor:
    return Preprocessor(tiny_model, Limits(max_request_bytes=1 << 20, max_audio_seconds=20, max_video_frames=8,
                                           max_image_pixels=1 << 20))


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: video_file(muxer=m, codec=v, sound=a) for name, (m, v, a) in CLIPS.items()}


@pytest.mark.parametrize("name", list(CLIPS))
def test_frames_are_transformers_pixels(tiny_model, pre, clips, name):
    got = pre.video_file(clips[name], 0.0, "media item 0")
    ref = reference_pixels(tiny_model, clips[name])
    gt, gh, gw = got.grid_thw
    assert gt * 2 == len(ref) == 4 and gh * gw == ref.shape[1]  # 2 s sampled at 2 fps
    assert got.num_tokens == gt * gh * gw // 4 and got.second_per_grid == pytest.approx(1.0)
    ours = PixelNorm(tiny_model)(torch.from_numpy(got.values), torch.float32).numpy()
    ours = ours.reshape(gt, gh * gw, 3, 2, -1).transpose(0, 3, 1, 2, 4).reshape(ref.shape)  # [frames, patches, C, P*P]
    np.testing.assert_allclose(ours, ref, rtol=0, atol=PIXEL_ATOL)


def test_sampling_is_transformers_at_many_lengths():
    ref = transformers_sample_frames()
    for total, rate, fps in [(50, 25.0, 2.0), (7, 30.0, 2.0), (3, 1.0, 2.0), (2000, 29.97, 2.0), (90, 30.0, 0.5), (61, 24.0, 5.0)]:
        assert sample_indices(total, rate, fps, 2).tolist() == ref(total, rate, fps).tolist(), (total, rate, fps)


@pytest.mark.parametrize("name", [n for n, (_, _, a) in CLIPS.items() if a])
def test_soundtrack_is_16k_mono_as_the_file_decodes_as_audio(pre, clips, name):
    got = pre.video_file(clips[name], 0.0).soundtrack
    assert got.dtype == np.float32 and got.ndim == 1
    assert abs(len(got) - 2 * 16000) <= 0.01 * 16000  # the encoder's priming and padding, a few ms
    np.testing.assert_array_equal(got, decode_file(clips[name], 16000, 20, "audio"))


def test_a_silent_clip_has_no_soundtrack(pre, clips):
    assert pre.video_file(clips["webm vp9"], 0.0).soundtrack is None


@pytest.mark.parametrize("name", ["mp4 h264 aac", "webm vp9 opus"])
def test_a_video_heard_is_its_frames_then_its_soundtrack_as_audio(pre, clips, name):
    """use_audio_in_video: the video's features, marked, then its soundtrack's log-mel as an audio file's would be
    (WhisperFeatureExtractor on the samples the same file gives as audio)."""
    from omni.stage.v1 import preprocess_pb2
    from omni.v1 import omni_pb2
    from services.preprocess.server import prepare

    item = preprocess_pb2.MediaItem(video=omni_pb2.Video(file=clips[name], use_audio_in_video=True))
    video, sound = prepare(pre, 0, item)
    plain = pre.video_file(clips[name], 0.0)
    assert video.kind == "video" and video.with_audio and np.array_equal(video.values, plain.values)
    pcm = decode_file(clips[name], 16000, 20, "audio")
    mel = pre.audio([pcm], sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, return_tensors="np")
    assert sound.kind == "audio" and sound.feature_length == int(mel["attention_mask"][0].sum())
    np.testing.assert_array_equal(sound.values, mel["input_features"][0][:, :sound.feature_length])
    assert not prepare(pre, 0, preprocess_pb2.MediaItem(video=omni_pb2.Video(file=clips[name])))[0].with_audio


def test_a_silent_clip_cannot_be_heard(pre, clips):
    from omni.stage.v1 import preprocess_pb2
    from omni.v1 import omni_pb2
    from services.preprocess.server import prepare

    item = preprocess_pb2.MediaItem(video=omni_pb2.Video(file=clips["webm vp9"], use_audio_in_video=True))
    with pytest.raises(InvalidArgument, match="media item 2: use_audio_in_video is set, but the video file has no audio stream"):
        prepare(pre, 2, item)
    frames = preprocess_pb2.MediaItem(video=omni_pb2.Video(frames=[omni_pb2.Image(data=b"x")], use_audio_in_video=True))
    with pytest.raises(InvalidArgument, match="media item 2: use_audio_in_video needs a video file"):
        prepare(pre, 2, frames)


def test_a_soundtrack_not_heard_is_never_decoded(pre, clips):
    """Without use_audio_in_video the audio stream is not read at all (Qwen's processor ignores it): a file whose
    soundtrack cannot be decoded gives the same frames as the good file, and is refused only when heard."""
    from omni.stage.v1 import preprocess_pb2
    from omni.v1 import omni_pb2
    from services.preprocess.server import prepare

    good = clips["mp4 h264 aac"]
    bad = garbled_sound(good, "mp4")
    item = lambda heard: preprocess_pb2.MediaItem(video=omni_pb2.Video(file=bad, use_audio_in_video=heard))
    with pytest.raises(InvalidArgument, match="media item 0: cannot decode video: Invalid data"):
        prepare(pre, 0, item(True))
    (video,) = prepare(pre, 0, item(False))
    assert not video.with_audio and video.soundtrack is None
    assert np.array_equal(video.values, pre.video_file(good, 0.0).values)


def portrait() -> np.ndarray:
    """A scene 96 wide and 128 tall: a white top-left corner over a vertical gradient, [128, 96, 3] uint8."""
    img = np.repeat(np.linspace(0, 200, 128, dtype=np.uint8)[:, None, None], 96, axis=1).repeat(3, axis=2)
    img[:40, :30] = 255
    return img


def turned_clip(stored: np.ndarray, muxer: str, codec: str, ccw: float | None = None, hflip: bool = False,
                tag: str | None = None) -> bytes:
    """1 s of `stored` at 25 fps whose display matrix turns it `ccw` degrees counterclockwise (then mirrors it), as
    a phone writes one, or whose stream carries a `rotate` tag instead."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        v = out.add_stream(codec, rate=25)
        v.height, v.width = stored.shape[:2]
        v.pix_fmt = "yuv420p"
        if ccw is not None:
            v.set_display_rotation(ccw, hflip=hflip)
        if tag is not None:
            v.metadata["rotate"] = tag
        for _ in range(25):
            for packet in v.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(stored), format="rgb24")):
                out.mux(packet)
        for packet in v.encode(None):
            out.mux(packet)
    return buf.getvalue()


# name -> (stored frame, muxer, codec, display matrix's counterclockwise degrees, hflip, rotate tag): each shows portrait()
TURNED = {
    "phone portrait mp4": (np.rot90(portrait(), 1), "mp4", "libx264", -90, False, None),
    "mov turned the other way": (np.rot90(portrait(), -1), "mov", "libx264", 90, False, None),
    "webm upside down": (np.rot90(portrait(), 2), "webm", "libvpx-vp9", 180, False, None),
    "mp4 mirrored": (portrait()[:, ::-1], "mp4", "libx264", 0, True, None),
    "mp4 transposed": (portrait().transpose(1, 0, 2), "mp4", "libx264", -90, True, None),
    "mov anti-transposed": (np.rot90(portrait(), -1)[::-1], "mov", "libx264", 90, True, None),
    "mkv rotate tag": (np.rot90(portrait(), 1), "matroska", "libx264", None, False, "90"),
}
# Mean absolute error of a decoded frame: H.264 and VP9 at their default quality on smooth content.
TURNED_ATOL = 4.0


@pytest.mark.parametrize("name", list(TURNED))
def test_frames_come_out_as_a_player_shows_them(pre, name):
    stored, muxer, codec, ccw, hflip, tag = TURNED[name]
    data = turned_clip(stored, muxer, codec, ccw, hflip, tag)
    clip = decode_video(data, pre.limits, "media item 0", 2.0, 2, 16000)
    assert clip.frames.shape == (4, 128, 96, 3)
    err = np.abs(clip.frames.astype(np.float32) - portrait()).mean(axis=(1, 2, 3))
    assert (err < TURNED_ATOL).all(), err
    if stored.shape == portrait().shape:  # the file's own orientation would fail the check above
        assert np.abs(stored.astype(np.float32) - portrait()).mean() > 3 * TURNED_ATOL
    upright = pre.video_file(turned_clip(portrait(), muxer, codec), 0.0)
    assert pre.video_file(data, 0.0).grid_thw == upright.grid_thw and upright.grid_thw[1] > upright.grid_thw[2]


def test_evenly_spaced_timestamps_sample_as_transformers():
    """Timestamps on an even grid, rounded to a millisecond as WebM stores them, pick transformers' frames."""
    ref = transformers_sample_frames()
    for total, rate, fps in [(50, 25.0, 2.0), (7, 30.0, 2.0), (2997, 29.97, 2.0), (2000, 29.97, 2.0), (90, 30.0, 0.5), (61, 24.0, 5.0)]:
        pts = np.round(np.arange(total) * 1000 / rate).astype(np.int64)
        keep, kept = sample_times(pts, int(round(total * 1000 / rate)), Fraction(1, 1000), Fraction(rate), fps, 2)
        assert keep.tolist() == ref(total, rate, fps).tolist(), (total, rate, fps)
        assert kept == pytest.approx(len(keep) / total * rate)


MS = Fraction(1, 1000)
# A variable rate: 1 s at 20 fps, then 2 s at 4 fps (28 frames); frame i is grey level 8 * i.
VFR_PTS = list(range(0, 1000, 50)) + list(range(1000, 3000, 250))


def vfr_clip(muxer: str, codec: str) -> bytes:
    """VFR_PTS (ms) as a file, each frame's packet lasting until the next frame (the last, 250 ms)."""
    lasts = dict(zip(VFR_PTS, np.diff([*VFR_PTS, 3000]).tolist()))
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        v = out.add_stream(codec, rate=20)
        v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
        v.codec_context.time_base = MS

        def mux(packets):
            for p in packets:
                p.duration = int(lasts[p.pts] * MS / p.time_base)
                out.mux(p)

        for i, t in enumerate(VFR_PTS):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 8 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = t, MS
            mux(v.encode(frame))
        mux(v.encode(None))
    return buf.getvalue()


@pytest.mark.parametrize("muxer,codec", [("matroska", "libx264"), ("webm", "libvpx-vp9"), ("mp4", "libx264")])
def test_a_variable_rate_is_sampled_by_its_timestamps(tiny_model, pre, muxer, codec):
    """3 s sampled at 2 fps: the frames on screen at 0, 0.5, ..., 2.5 s (each starts at its instant, so it is also
    the nearest), not every 28/6th frame; one temporal patch is 1 s, so M-RoPE's time row steps 13 a patch."""
    from services.model.positions import Layout, mrope_positions, tokens_from_config
    from services.model.spec import OmniSpec

    data = vfr_clip(muxer, codec)
    with av.open(io.BytesIO(data)) as c:
        rate = c.streams.video[0].average_rate
    shown = [VFR_PTS.index(t) for t in (0, 500, 1000, 1500, 2000, 2500)]
    assert sample_indices(len(VFR_PTS), float(rate), 2.0, 2).tolist() != shown  # by index at the container's rate
    clip = decode_video(data, pre.limits, "media item 0", 2.0, 2, 16000)
    assert np.round(clip.frames.mean(axis=(1, 2, 3)) / 8).astype(int).tolist() == shown
    video = pre.video_file(data, 0.0)
    assert clip.fps == pytest.approx(2.0) and video.second_per_grid == pytest.approx(1.0) and video.grid_thw[0] == 3
    tok = tokens_from_config(OmniSpec.load(tiny_model).thinker)
    ids = [tok.vision_start] + [tok.video] * video.num_tokens + [tok.vision_start + 1]
    layout = Layout(video_grid_thw=[video.grid_thw], video_second_per_grid=[video.second_per_grid])
    t_row = mrope_positions(ids, layout, tok)[0][0, 1:-1]
    assert sorted(set((t_row - 1).tolist())) == [0.0, 13.0, 26.0]


def test_a_frame_on_screen_at_two_instants_is_sampled_twice():
    """A frame held for a second, sampled at 2 fps, is what a viewer sees at both instants."""
    pts = np.array([0, 1000, 1100, 1200, 1300], dtype=np.int64)
    keep, kept = sample_times(pts, 2000, MS, Fraction(5, 2), 2.0, 2)
    assert keep.tolist() == [0, 0, 1, 4] and kept == 2.0  # instants 0, 0.5, 1 and 1.5 s


def test_a_lone_frame_keeps_nothing_even_without_a_duration():
    keep, kept = sample_times(np.array([40], dtype=np.int64), 40, MS, None, 2.0, 2)
    assert len(keep) == 0 and kept == 0.0


def test_fps_samples_the_file(pre, clips):
    assert pre.video_file(clips["mp4 h264"], 4.0).grid_thw[0] == 4  # 8 frames of 2 s
    with pytest.raises(InvalidArgument, match="media item 0: fps must be in"):
        pre.video_file(clips["mp4 h264"], 100.0, "media item 0")


def cut(data: bytes, fraction: float) -> bytes:
    return data[: int(len(data) * fraction)]


BAD = {  # name -> (file, error, words)
    "empty": (lambda: b"", InvalidArgument, "media item 1: empty video file"),
    "file bytes": (lambda: bytes(2 << 20), ResourceExhausted, "video file of 2097152 bytes is over the limit of 1048576"),
    "not a video": (lambda: b"RIFF" + bytes(300), InvalidArgument, "cannot decode video (MP4, MOV, MKV or WebM expected)"),
    "playlist": (lambda: b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", InvalidArgument, "cannot decode video"),
    "corrupt": (lambda: (d := video_file())[:2000] + bytes(3000) + d[5000:], InvalidArgument, "cannot decode video"),
    "truncated mp4": (lambda: cut(video_file(), 0.5), InvalidArgument, "cannot decode video"),
    "truncated webm": (lambda: cut(video_file(muxer="webm", codec="libvpx-vp9"), 0.5), InvalidArgument,
                       "the video file is truncated: its header says 2.0 s, its frames stop at 0.7 s"),
    "unsupported codec": (lambda: video_file(codec="mpeg4"), InvalidArgument,
                          "video codec mpeg4 is not supported (H.264, HEVC, VP8, VP9, AV1)"),
    "no video stream": (lambda: transcode(wav(1), "webm", "libopus"), InvalidArgument, "the Matroska / WebM file has no video stream"),
    "one frame": (lambda: video_file(0.04), InvalidArgument, "a video needs at least 2 frames, the file has 1"),
    "pixels per frame": (lambda: video_file(0.2, 1280, 1024), ResourceExhausted,
                         "video frames of 1280x1024 = 1310720 pixels are over the limit of 1048576"),
    "duration": (lambda: video_file(25, 32, 32, rate=2), ResourceExhausted, "25.0 s of video is over the limit of 20 s"),
    "frames after sampling": (lambda: video_file(6, 32, 32, rate=5), ResourceExhausted,
                              "12 frames sampled at 2 fps is over the limit of 8"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_files_are_refused_by_item(pre, name):
    make, error, words = BAD[name]
    with pytest.raises(error) as e:
        pre.video_file(make(), 0.0, "media item 1")
    assert "media item 1: " in str(e.value) and words in str(e.value), str(e.value)


def test_tokens_past_the_context_are_refused_before_decoding(tiny_model):
    small = Preprocessor(tiny_model, Limits(), context=100)
    with pytest.raises(InvalidArgument, match="media item 0: 160x120 makes 280 tokens, more than the context of 100"):
        small.video_file(video_file(), 0.0, "media item 0")
