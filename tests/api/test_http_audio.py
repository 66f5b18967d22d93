"""Speech out through the HTTP door, in every format, decoded back by decoders independent of the gateway's encoding
(tests/api/decoders.py) and held to the PCM16 stream of the same seeded request through gRPC."""

import base64
import json
import time

import numpy as np
import pytest

from api.calls import as_chat, read_stream
from api.decoders import FRAME, decode, lag
from api.test_audio_out import TAIL
from api.test_http_chat import create
from client_util import generate
from omni.v1 import omni_pb2
from references import Case
from services.api.translate import READ_ALOUD

FORMATS = ["wav", "pcm16", "flac", "mp3", "opus", "aac"]
# On the tiny model's speech (random weights: noise-like, energy up to 12 kHz) each codec's waveform correlation with
# the PCM16 it was made from (measured: MP3 0.83, its 64 kbit/s low-pass cutting the top band; Opus 0.90; AAC 0.97).
MIN_CORR = {"mp3": 0.7, "opus": 0.8, "aac": 0.9}


def band_db(x: np.ndarray, n: int = 480) -> np.ndarray:
    """Energy in 24 log-spaced bands of each 20 ms frame, in dB: what a perceptual codec keeps."""
    frames = len(x) // n
    spectrum = np.abs(np.fft.rfft(x[:frames * n].reshape(frames, n) * np.hanning(n), axis=1)) ** 2
    edges = np.unique(np.geomspace(1, spectrum.shape[1], 25).astype(int))
    return 10 * np.log10(np.stack([spectrum[:, a:b].sum(1) for a, b in zip(edges, edges[1:])], 1) + 1e-9)


def check_audio(data: bytes, fmt: str, ref: np.ndarray) -> None:
    """`data` (a whole reply, or its deltas joined) decodes to `ref` within what `fmt` keeps of it."""
    decoded, rate = decode(data, fmt)
    assert rate == 24000
    if fmt in ("wav", "pcm16", "flac"):  # lossless
        assert len(decoded) == len(ref) and np.array_equal(np.round(decoded * 32768), np.round(ref * 32768)), fmt
        return
    k = lag(decoded, ref)
    extra = len(decoded) - k - len(ref)
    assert 0 <= extra < FRAME[fmt] + TAIL.get(fmt, 0), f"{fmt}: {len(decoded)} decoded, primed by {k}, for {len(ref)}"
    got = decoded[k:k + len(ref)]
    assert np.corrcoef(got, ref)[0, 1] > MIN_CORR[fmt], fmt
    have, want = band_db(got), band_db(ref)
    loud = want > want.max() - 40
    assert np.median(np.abs(have - want)[loud]) < 1.5, fmt


def pcm16_of(mesh, req: omni_pb2.GenerateRequest) -> np.ndarray:
    req = omni_pb2.GenerateRequest.FromString(req.SerializeToString())
    req.audio_format, req.return_codec_codes = omni_pb2.AUDIO_FORMAT_PCM16, False
    res = generate(mesh.gateway_address, req)
    return np.round(np.concatenate(res.pcm) * 32767.0) / 32768.0  # the PCM16 samples, as a decoder reads them


def speech_case() -> omni_pb2.GenerateRequest:
    req = Case([("user", [("text", "Tell me a story.")])]).request(speech=True, max_tokens=10, frames=40, greedy=False,
                                                                    codes=False)
    req.sampling.seed, req.talker_sampling.seed = 11, 12
    req.talker_sampling.ignore_eos = True
    return req


@pytest.fixture(scope="module")
def reference(mesh) -> np.ndarray:
    return pcm16_of(mesh, speech_case())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_chat_audio_in_every_format(client, reference, fmt, stream):
    body = as_chat(speech_case(), audio_format=fmt)
    t0 = time.time()
    if stream:
        s = read_stream(create(client, body, stream=True))
        data, transcript, text, audio_id, expires = s.audio, s.transcript, s.text, s.audio_id, s.expires_at
        # Streamed as it is made: every codec's chunks come as they are encoded (WAV alone is one file at the end).
        assert s.audio_deltas == 1 if fmt == "wav" else s.audio_deltas >= 3
    else:
        m = create(client, body).choices[0].message
        data, transcript, text = base64.b64decode(m.audio.data), m.audio.transcript, m.content
        audio_id, expires = m.audio.id, m.audio.expires_at
    assert transcript == text and audio_id.startswith("audio_")
    assert t0 + 3600 - 5 <= expires <= time.time() + 3600 + 5
    check_audio(data, fmt, reference)


SPEECH_FORMATS = {"wav": "wav", "pcm": "pcm16", "flac": "flac", "mp3": "mp3", "opus": "opus", "aac": "aac"}


def speech_reference(mesh, text: str) -> np.ndarray:
    """What /v1/audio/speech asks the mesh, through gRPC: the model reading `text`, greedy, seeded speech."""
    req = Case([("system", [("text", READ_ALOUD)]), ("user", [("text", text)])]).request(
        speech=True, max_tokens=8, frames=30, greedy=True, codes=False)
    req.output_modalities[:] = [omni_pb2.MODALITY_AUDIO]
    req.talker_sampling.ClearField("temperature")
    req.sampling.ignore_eos = True
    req.talker_sampling.seed, req.talker_sampling.ignore_eos = 5, True
    return pcm16_of(mesh, req)


SPEECH_EXTRA = {"thinker": {"max_tokens": 8, "ignore_eos": True}, "talker": {"max_tokens": 30, "seed": 5, "ignore_eos": True}}


@pytest.mark.parametrize("fmt", list(SPEECH_FORMATS))
def test_speech_in_every_format(mesh, client, fmt):
    ref = speech_reference(mesh, "Hello there, world.")
    reply = client.audio.speech.create(model="tiny", voice="ethan", input="Hello there, world.", response_format=fmt,
                                       extra_body=SPEECH_EXTRA)
    check_audio(reply.content, SPEECH_FORMATS[fmt], ref)
    with client.audio.speech.with_streaming_response.create(model="tiny", voice="ethan", input="Hello there, world.",
                                                            response_format=fmt, extra_body=SPEECH_EXTRA) as streamed:
        assert streamed.headers["content-type"].startswith({"pcm": "audio/pcm", "opus": "audio/ogg"}.get(fmt, "audio/"))
        check_audio(b"".join(streamed.iter_bytes()), SPEECH_FORMATS[fmt], ref)


def test_speech_as_server_sent_events(mesh, client):
    ref = speech_reference(mesh, "Hello there, world.")
    with client.audio.speech.with_streaming_response.create(model="tiny", voice="ethan", input="Hello there, world.",
                                                            response_format="mp3", stream_format="sse",
                                                            extra_body=SPEECH_EXTRA) as streamed:
        events = [json.loads(line[len("data: "):]) for line in streamed.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3 and events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == 8 + 30 and usage["total_tokens"] == usage["input_tokens"] + 38
    check_audio(b"".join(base64.b64decode(e["audio"]) for e in deltas), "mp3", ref)
