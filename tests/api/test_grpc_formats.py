"""The encoded AudioFormats over the public gRPC API itself (any language's client gets them): chunks in order, each
with the speech it carries, the codec's held-back rest in a last chunk of duration 0, the codes beside their chunk."""

import grpc
import pytest

from api.decoders import decode
from omni.v1 import omni_pb2, omni_pb2_grpc
from references import Case

ENCODED = {"mp3": omni_pb2.AUDIO_FORMAT_MP3, "opus": omni_pb2.AUDIO_FORMAT_OPUS, "aac": omni_pb2.AUDIO_FORMAT_AAC,
           "flac": omni_pb2.AUDIO_FORMAT_FLAC}


def chunks(address: str, audio_format: int) -> list[omni_pb2.AudioChunk]:
    req = Case([("user", [("text", "Tell me a story.")])]).request(speech=True, max_tokens=8, frames=24)
    req.talker_sampling.ignore_eos = True
    req.audio_format = audio_format
    with grpc.insecure_channel(address) as ch:
        return [r.audio for r in omni_pb2_grpc.OmniStub(ch).Generate(req, timeout=120) if r.HasField("audio")]


@pytest.mark.parametrize("fmt", list(ENCODED))
def test_encoded_formats_stream_over_grpc(mesh, fmt):
    pcm = chunks(mesh.gateway_address, omni_pb2.AUDIO_FORMAT_PCM16)
    got = chunks(mesh.gateway_address, ENCODED[fmt])
    assert len(got) == len(pcm) + 1 and [c.index for c in got] == list(range(len(got)))
    assert all(c.format == ENCODED[fmt] and c.sample_rate == 24000 for c in got)
    for mine, plain in zip(got, pcm):  # each chunk is the same speech as the PCM16 chunk, encoded as it came
        assert (mine.start_seconds, mine.duration_seconds) == (plain.start_seconds, plain.duration_seconds)
        assert list(mine.codec_codes) == list(plain.codec_codes) and mine.num_codebooks == plain.num_codebooks
        assert mine.data, "a chunk's speech left the encoder with it"
    last = got[-1]
    assert last.duration_seconds == 0 and last.start_seconds == pytest.approx(sum(c.duration_seconds for c in pcm))
    samples, _ = decode(b"".join(c.data for c in got), fmt)
    assert len(samples) >= sum(len(c.data) // 2 for c in pcm)  # every sample, and the codec's priming
