"""A session's input audio: chunks in the client's PCM format checked and resampled to 16 kHz PCM16 as they come,
and turn detection over them with WebRTC's voice-activity detector."""

from collections import deque

import av
import numpy as np
import webrtcvad

from omni.v1 import omni_pb2
from services.runtime.errors import InvalidArgument

RATE = 16000  # what the audio tower takes, and a rate the detector knows
FRAME_MS = 30  # the detector's longest frame: the steadiest decision per frame
FRAME_BYTES = RATE * FRAME_MS // 1000 * 2
# A session's defaults where its TurnDetection leaves them unset (docs/operations.md, "Conversations")
AGGRESSIVENESS = 2  # WebRTC's detector: 0 takes the most frames for speech, 3 the fewest
SPEECH_MS = 150  # speech that starts a turn, and interrupts an answer: shorter sounds are not speech
SILENCE_MS = 500  # silence after speech that commits the turn, as OpenAI's server VAD waits
MIN_RATE, MAX_RATE = 8000, 48000
# Of the frames in a window, the share that must agree before speech is said to start or stop
START_SHARE, STOP_SHARE = 0.8, 0.9
ENCODINGS = {omni_pb2.PCM_ENCODING_S16LE: ("<i2", "s16"), omni_pb2.PCM_ENCODING_F32LE: ("<f4", "flt")}


class InputAudio:
    """Chunks of mono PCM (`encoding` at `rate`) -> 16 kHz PCM16, one stateful resampler so chunk edges leave no
    seams; a bad chunk is refused whole and the stream goes on."""

    def __init__(self, encoding: int, rate: int):
        encoding = encoding or omni_pb2.PCM_ENCODING_S16LE
        if encoding not in ENCODINGS:
            raise InvalidArgument(f"input_encoding {encoding} is not S16LE (1) or F32LE (2)")
        if not MIN_RATE <= rate <= MAX_RATE:
            raise InvalidArgument(f"input_sample_rate {rate} is outside {MIN_RATE} to {MAX_RATE} Hz")
        (self.dtype, self.av_format), self.rate = ENCODINGS[encoding], rate
        self.resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE) if rate != RATE else None

    def push(self, data: bytes) -> bytes:
        width = np.dtype(self.dtype).itemsize
        if not data:
            raise InvalidArgument("the audio chunk is empty")
        if len(data) % width:
            raise InvalidArgument(f"an audio chunk of {len(data)} bytes is not a whole number of {width}-byte samples")
        pcm = np.frombuffer(data, self.dtype)
        if self.dtype == "<f4":
            if not np.isfinite(pcm).all():
                raise InvalidArgument("the audio chunk holds NaN or infinite samples")
            if np.abs(pcm).max() > 1.0:
                raise InvalidArgument("F32LE samples must lie in [-1, 1]")
        if self.resampler is None:
            return pcm.astype("<i2").tobytes() if self.dtype == "<i2" else (pcm * 32767.0).round().astype("<i2").tobytes()
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format=self.av_format, layout="mono")
        frame.sample_rate = self.rate
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in self.resampler.resample(frame))


class TurnDetector:
    """Speech starts when START_SHARE of the last `speech_ms` of frames are voiced, and stops when STOP_SHARE of the
    last `silence_ms` are not; positions are in seconds of the audio pushed so far."""

    def __init__(self, aggressiveness: int, speech_ms: int, silence_ms: int):
        if not 0 <= aggressiveness <= 3:
            raise InvalidArgument(f"turn_detection.aggressiveness must be 0 to 3, got {aggressiveness}")
        if speech_ms < FRAME_MS or silence_ms < FRAME_MS:
            raise InvalidArgument(f"turn_detection.speech_ms and silence_ms must be at least {FRAME_MS}, "
                                  f"got {speech_ms} and {silence_ms}")
        self.vad = webrtcvad.Vad(aggressiveness)
        self.start_window = deque(maxlen=max(1, speech_ms // FRAME_MS))
        self.stop_window = deque(maxlen=max(1, silence_ms // FRAME_MS))
        self.pending = b""
        self.frames = 0
        self.speaking = False

    def push(self, pcm16: bytes) -> list[tuple[str, float]]:
        """16 kHz PCM16 -> [("started" | "stopped", seconds)] in order."""
        self.pending += pcm16
        events = []
        while len(self.pending) >= FRAME_BYTES:
            frame, self.pending = self.pending[:FRAME_BYTES], self.pending[FRAME_BYTES:]
            voiced = self.vad.is_speech(frame, RATE)
            self.frames += 1
            window = self.stop_window if self.speaking else self.start_window
            window.append(voiced)
            full = len(window) == window.maxlen
            if not self.speaking and full and sum(window) >= START_SHARE * len(window):
                self.speaking = True
                self.stop_window.clear()
                events.append(("started", (self.frames - len(window)) * FRAME_MS / 1000))
            elif self.speaking and full and len(window) - sum(window) >= STOP_SHARE * len(window):
                self.speaking = False
                self.start_window.clear()
                events.append(("stopped", self.frames * FRAME_MS / 1000))
        return events
