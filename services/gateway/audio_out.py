"""Speech out in encoded formats: one PyAV (FFmpeg) encoder per request, PCM16 chunks in, container bytes out as
they are made, so the joined bytes are one file of the format and every piece of it is playable as it comes."""

from dataclasses import dataclass, field

import av
import numpy as np

from omni.v1 import omni_pb2


@dataclass(frozen=True)
class Encoding:
    container: str
    codec: str
    bit_rate: int = 0
    container_options: dict = field(default_factory=dict)
    codec_options: dict = field(default_factory=dict)


# flush_packets: FFmpeg's I/O buffer handed to us after every packet, not once 32 KB have gathered.
ENCODINGS = {
    # No ID3 tag and no Xing frame: the stream is MP3 frames alone (a Xing frame is rewritten at the end, which a
    # stream cannot do, and would otherwise decode as a frame of silence).
    omni_pb2.AUDIO_FORMAT_MP3: Encoding("mp3", "libmp3lame", 64000,
                                        {"id3v2_version": "0", "write_xing": "0", "flush_packets": "1"}),
    # A page per 20 ms packet: the Ogg muxer otherwise holds a second of packets back before it writes a page.
    omni_pb2.AUDIO_FORMAT_OPUS: Encoding("ogg", "libopus", 32000, {"page_duration": "20000", "flush_packets": "1"}),
    omni_pb2.AUDIO_FORMAT_AAC: Encoding("adts", "aac", 64000, {"flush_packets": "1"}),
    # Blocks of 1152 samples (48 ms) rather than FFmpeg's 4608 at this rate: the first bytes leave 150 ms sooner; no
    # 8 KB of header padding (kept for tags a stream never gets).
    omni_pb2.AUDIO_FORMAT_FLAC: Encoding("flac", "flac", 0, {"metadata_header_padding": "0", "flush_packets": "1"},
                                         {"frame_size": "1152"}),
}


class _Sink:
    """A write-only, unseekable file for the muxer: what it writes is taken after every push."""

    def __init__(self):
        self.buf = bytearray()

    def write(self, data) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class AudioEncoder:
    """PCM16 mono at `rate` -> the bytes of `audio_format` (one of ENCODINGS), streamed: `push` returns what the
    encoder could finish from the samples so far, `close` the rest (the codec's held-back lookahead, the trailer)."""

    def __init__(self, audio_format: int, rate: int):
        enc = ENCODINGS[audio_format]
        self.rate, self.samples, self.sink = rate, 0, _Sink()
        self.container = av.open(self.sink, mode="w", format=enc.container, options=enc.container_options)
        self.stream = self.container.add_stream(enc.codec, rate=rate, layout="mono")
        if enc.bit_rate:
            self.stream.bit_rate = enc.bit_rate
        self.stream.codec_context.options = dict(enc.codec_options)

    def push(self, pcm16: bytes) -> bytes:
        samples = np.frombuffer(pcm16, "<i2")
        if len(samples):
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.samples
            self.samples += len(samples)
            self._mux(frame)  # PyAV cuts and converts the samples into the codec's own frames
        return self.sink.take()

    def close(self) -> bytes:
        self._mux(None)
        self.container.close()
        return self.sink.take()

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self.stream.encode(frame):
            self.container.mux(packet)
