"""Audio files in, through PyAV (services/preprocess/audio_in.py): every container the API lists decodes to the speech
the WAV of the same samples gives, the same as soundfile read it before; bad files are refused by item."""

import io

import av
import numpy as np
import pytest
import soundfile as sf

from references import wav
from services.preprocess.audio_in import decode_file
from services.preprocess.media import Preprocessor
from services.runtime.config import Limits
from services.runtime.errors import InvalidArgument, ResourceExhausted

# (FFmpeg muxer, encoder) of each input format, made here from one 44.1 kHz stereo WAV.
MADE = {"mp3": ("mp3", "libmp3lame"), "flac": ("flac", "flac"), "ogg": ("ogg", "libopus"), "webm": ("webm", "libopus"),
        "m4a": ("ipod", "aac")}


def transcode(data: bytes, muxer: str, codec: str) -> bytes:
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format=muxer) as dst:
        stream = dst.add_stream(codec, rate=48000 if codec == "libopus" else src.streams.audio[0].rate, layout="stereo")
        for frame in src.decode(audio=0):
            frame.pts = None
            for packet in stream.encode(frame):
                dst.mux(packet)
        for packet in stream.encode(None):
            dst.mux(packet)
    return out.getvalue()


def stereo(seconds: float = 1.5, rate: int = 44100) -> bytes:
    """Different left and right channels (a downmix that kept one of them would show), gliding tones that never
    repeat (a shift between two decodes is found where they line up)."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = np.stack([0.3 * np.sin(2 * np.pi * (300 * t + 200 * t ** 2)), 0.2 * np.sin(2 * np.pi * (900 * t - 150 * t ** 2))], axis=1)
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pre(tiny_model) -> Preprocessor:
    return Preprocessor(tiny_model, Limits(max_audio_seconds=20))


def soundfile_path(pre: Preprocessor, data: bytes):
    """What preprocess made of a WAV or FLAC file before PyAV: soundfile's samples, channels averaged, scipy's
    polyphase resampler to 16 kHz, then the same feature extractor."""
    from scipy.signal import resample_poly

    pcm, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = pcm.mean(axis=1)
    if rate != 16000:
        g = np.gcd(rate, 16000)
        mono = resample_poly(mono, 16000 // g, rate // g).astype(np.float32)
    return mono, pre._audio(mono, 16000, "reference")


@pytest.mark.parametrize("rate", [16000, 44100])
@pytest.mark.parametrize("container", ["wav", "flac"])
def test_wav_and_flac_give_what_soundfile_gave(pre, container, rate):
    data = stereo(rate=rate)
    if container == "flac":
        data = transcode(data, "flac", "flac")
    ref_pcm, ref = soundfile_path(pre, data)
    pcm = decode_file(data, 16000, 20, "item")
    got = pre.audio_file(data)
    assert got.num_tokens == ref.num_tokens and got.feature_length == ref.feature_length
    if rate == 16000:  # nothing resampled: the very same samples and features
        assert np.array_equal(pcm, ref_pcm) and np.array_equal(got.values, ref.values)
    else:  # FFmpeg's resampler against scipy's: the same speech, filters (and how each pads the ends) apart
        assert np.abs(pcm - ref_pcm)[100:-100].max() < 1e-3
        assert np.abs(got.values - ref.values).mean() < 0.01 and np.abs(got.values - ref.values).max() < 0.2


@pytest.mark.parametrize("fmt", list(MADE))
def test_every_listed_format_decodes_to_the_same_speech(pre, fmt):
    data = stereo()
    ref = decode_file(data, 16000, 20, "item")
    pcm = decode_file(transcode(data, *MADE[fmt]), 16000, 20, "item")
    # Encoders prime their stream (AAC in M4A: 1024 samples, not trimmed by the muxer used here); the rest is the speech.
    shift = int(np.argmax(np.correlate(pcm[:len(ref) + 2000], ref[:8000], "valid")))
    assert shift < 1000 and abs(len(pcm) - shift - len(ref)) < 1200, (shift, len(pcm), len(ref))
    n = min(len(ref), len(pcm) - shift)
    assert np.corrcoef(pcm[shift:shift + n], ref[:n])[0, 1] > 0.99, fmt
    assert pre.audio_file(transcode(data, *MADE[fmt])).num_tokens > 0


def test_raw_pcm_and_the_same_samples_as_a_file_give_the_same_features(pre):
    """One resampler for both: a clip sent as RawPcm at 44.1 kHz and as a WAV of the same samples are the same input."""
    data = stereo(rate=44100)
    pcm, _ = sf.read(io.BytesIO(data), dtype="int16")
    raw, file = pre.audio_pcm(pcm.tobytes(), 44100, "s16le", 2), pre.audio_file(data)
    # The file's channels are resampled before they are averaged, RawPcm's after: float rounding apart.
    assert raw.feature_length == file.feature_length and np.abs(raw.values - file.values).max() < 1e-4


def test_duration_is_refused_from_the_header_before_decoding(pre):
    """A FLAC's STREAMINFO gives its length: cut to its first 30 KB (a second of the samples), its 25 s are refused."""
    cut = transcode(wav(7, seconds=25), "flac", "flac")[:30000]
    with pytest.raises(ResourceExhausted, match=r"media item 2: 25.0 s of audio is over the limit of 20 s"):
        pre.audio_file(cut, "media item 2")
    with pytest.raises(ResourceExhausted, match=r"media item 2: 25.0 s of audio is over the limit of 20 s"):
        pre.audio_file(wav(7, seconds=25), "media item 2")


def video_only() -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=5)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for packet in [*s.encode(frame), *s.encode(None)]:
            c.mux(packet)
    return out.getvalue()


def aiff() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(16000, np.float32), 16000, format="AIFF")
    return buf.getvalue()


@pytest.mark.parametrize("data,error,words", [
    (b"", InvalidArgument, "media item 1: empty audio"),
    (b"RIFF" + bytes(300), InvalidArgument, "media item 1: cannot decode audio (WAV, MP3, FLAC, Ogg, WebM or M4A expected)"),
    (wav(3)[:30], InvalidArgument, "media item 1: cannot decode audio"),
    (b"\x89PNG\r\n\x1a\n" + bytes(200), InvalidArgument, "media item 1: cannot decode audio"),
    (aiff(), InvalidArgument, "media item 1: cannot decode audio"),  # a format FFmpeg reads, but not one listed
    (video_only(), InvalidArgument, "media item 1: the QuickTime / MOV file has no audio stream"),
    (b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", InvalidArgument, "media item 1: cannot decode audio"),
])
def test_bad_files_are_refused_by_item(pre, data, error, words):
    with pytest.raises(error) as e:
        pre.audio_file(data, "media item 1")
    assert words in str(e.value)
