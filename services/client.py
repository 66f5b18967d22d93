"""A small client of the public API: prints the text as it streams, writes the speech to a WAV file.

    python -m services.client "Describe this." [--image a.png] [--audio b.wav] [--speech out.wav] [--address HOST:PORT]
                              [--tls-ca ca.pem] [--api-key KEY]

With --converse, a spoken conversation on one Converse session: each file given is one user turn, spoken into the
session as audio chunks, and each answer's speech is written to --speech (out-1.wav, out-2.wav, ... for several):

    python -m services.client --converse question.wav [--converse follow-up.wav] --speech out.wav
"""

import argparse
import io
import queue
import sys
import wave
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np

from omni.v1 import omni_pb2, omni_pb2_grpc


def request(text: str, images: list[bytes] = (), audios: list[bytes] = (), speech: bool = False, voice: str = "",
            max_tokens: int | None = None, max_frames: int | None = None, temperature: float | None = None) -> omni_pb2.GenerateRequest:
    parts = [omni_pb2.Part(image=omni_pb2.Image(data=d)) for d in images]
    parts += [omni_pb2.Part(audio=omni_pb2.Audio(file=d)) for d in audios]
    parts.append(omni_pb2.Part(text=text))
    req = omni_pb2.GenerateRequest(
        messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=parts)],
        output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech else []), voice=voice,
    )
    if max_tokens is not None:
        req.sampling.max_tokens = max_tokens
    if temperature is not None:
        req.sampling.temperature = req.talker_sampling.temperature = temperature
    if max_frames is not None:
        req.talker_sampling.max_tokens = max_frames
    return req


def _channel(address: str, tls_ca: Path | None) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 1 << 30)]
    return grpc.insecure_channel(address, options) if tls_ca is None else \
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()), options)


def _write_wav(path: Path, pcm: bytes, rate: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)


def run(address: str, req: omni_pb2.GenerateRequest, speech_path: Path | None, out=sys.stdout,
        tls_ca: Path | None = None, api_key: str = "") -> omni_pb2.Finished:
    """One request, streamed; over TLS trusting `tls_ca` when given, with `api_key` as its bearer when given."""
    pcm, rate = bytearray(), 0
    finished = None
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    with _channel(address, tls_ca) as channel:
        for resp in omni_pb2_grpc.OmniStub(channel).Generate(req, metadata=metadata):
            event = resp.WhichOneof("event")
            if event == "text":
                out.write(resp.text.text)
                out.flush()
            elif event == "audio":
                pcm += resp.audio.data
                rate = resp.audio.sample_rate
            else:
                finished = resp.finished
    out.write("\n")
    if speech_path is not None and rate:  # some audio came, at the chunks' rate
        _write_wav(speech_path, bytes(pcm), rate)
    return finished


def speech_of(path: Path) -> tuple[bytes, int]:
    """An audio file as mono PCM16 at its own rate (24 kHz where that is outside what a session takes)."""
    import av

    with av.open(str(path)) as f:
        stream = f.streams.audio[0]
        rate = stream.rate if 8000 <= stream.rate <= 48000 else 24000
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        frames = [r for frame in f.decode(stream) for r in resampler.resample(frame)] + resampler.resample(None)
    return b"".join(fr.to_ndarray().tobytes() for fr in frames), rate


def turn_paths(speech_path: Path | None, turns: int) -> list[Path | None]:
    if speech_path is None or turns == 1:
        return [speech_path] * turns
    return [speech_path.with_name(f"{speech_path.stem}-{i + 1}{speech_path.suffix}") for i in range(turns)]


@contextmanager
def _ending(events: queue.Queue):
    """The request stream ended however the session's reading stops, so that its sending thread does too."""
    try:
        yield
    finally:
        events.put(None)


def converse(address: str, clips: list[tuple[bytes, int]], settings: omni_pb2.SessionSettings,
             speech_path: Path | None, out=sys.stdout, err=sys.stderr, tls_ca: Path | None = None,
             api_key: str = "", chunk_s: float = 0.1) -> list[omni_pb2.TurnDone]:
    """A Converse session of one user turn per clip (PCM16, rate), each sent as audio chunks then committed once the
    answer before it is done; each answer's text printed as it streams and its speech written to a WAV file."""
    events: queue.Queue = queue.Queue()  # what the request stream sends next; None ends it

    def requests():
        while (req := events.get()) is not None:
            yield req

    def speak(pcm: bytes, rate: int) -> None:
        s = omni_pb2.SessionSettings()
        s.CopyFrom(settings)
        s.input_encoding, s.input_sample_rate = omni_pb2.PCM_ENCODING_S16LE, rate
        events.put(omni_pb2.ConverseRequest(settings=s))
        step = int(rate * chunk_s) * 2
        for i in range(0, len(pcm), step):
            events.put(omni_pb2.ConverseRequest(audio=pcm[i:i + step]))
        events.put(omni_pb2.ConverseRequest(commit=omni_pb2.Commit()))

    paths, done, pcm = turn_paths(speech_path, len(clips)), [], bytearray()
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    speak(*clips[0])
    with _channel(address, tls_ca) as channel, _ending(events):
        call = omni_pb2_grpc.OmniStub(channel).Converse(requests(), metadata=metadata)
        for resp in call:
            event = resp.WhichOneof("event")
            if event == "text":
                out.write(resp.text.text)
                out.flush()
            elif event == "audio":
                pcm += resp.audio.data
            elif event == "error":
                e = resp.error
                err.write(f"error: {e.code}: {e.message}\n")
                if not resp.turn_id:  # the session refused what we sent: the turn would be wrong, if any
                    call.cancel()
                    raise SystemExit(1)
            elif event == "done":
                out.write("\n")
                d, path = resp.done, paths[len(done)]
                if path is not None and pcm:
                    _write_wav(path, bytes(pcm), 24000)
                u = d.usage
                err.write(f"[{omni_pb2.TurnStatus.Name(d.status)}] {u.prompt_tokens} prompt + {u.completion_tokens} "
                          f"completion tokens, {u.audio_seconds:.2f} s of speech" + (f" in {path}" if pcm and path else "") + "\n")
                done.append(d)
                pcm = bytearray()
                if len(done) < len(clips):
                    speak(*clips[len(done)])
                else:
                    events.put(None)  # said all: the session ends once its last answer is out
    return done


def demo_media() -> tuple[bytes, bytes]:
    """A small synthetic picture (PNG) and one second of a chord (WAV), made on the spot."""
    from PIL import Image

    y, x = np.mgrid[0:96, 0:128]
    img = np.stack([x * 2, y * 2, (x + y) % 256], axis=-1).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    t = np.arange(16000) / 16000
    tone = (0.2 * (np.sin(2 * np.pi * 440 * t) + np.sin(2 * np.pi * 554 * t)) * 32767).astype("<i2")
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(tone.tobytes())
    return png.getvalue(), wav.getvalue()


def demo(address: str, speech_path: Path) -> None:
    png, wav = demo_media()
    req = request("What do you see and hear?", [png], [wav], speech=True, max_tokens=24, max_frames=40)
    req.sampling.seed = req.talker_sampling.seed = 1  # the same demo every time
    req.talker_sampling.ignore_eos = True  # a random-weight model's speech is otherwise cut short at random
    print(f"demo request to {address}: an image, a sound and a question; text and speech out")
    finished = run(address, req, speech_path)
    u = finished.usage
    print(f"finished: {omni_pb2.FinishReason.Name(finished.reason)}, {u.prompt_tokens} prompt + {u.completion_tokens} "
          f"completion tokens, {u.audio_seconds:.2f} s of speech in {speech_path}; first token after "
          f"{u.time_to_first_token_seconds * 1000:.0f} ms, first audio after {u.time_to_first_audio_seconds * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="?", default=None)
    parser.add_argument("--converse", action="append", default=[], type=Path, metavar="FILE",
                        help="one spoken user turn of a Converse session (repeat for more)")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--image", action="append", default=[], type=Path)
    parser.add_argument("--audio", action="append", default=[], type=Path)
    parser.add_argument("--speech", type=Path, default=None, help="ask for speech and write it to this WAV file")
    parser.add_argument("--voice", default="")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-frames", type=int, default=None, help="of speech, at most, per answer")
    parser.add_argument("--temperature", type=float, default=None, help="of the text and the speech (0: greedy)")
    parser.add_argument("--tls-ca", type=Path, default=None, help="the CA to trust: the gateway serves TLS")
    parser.add_argument("--api-key", default="", help="sent as `authorization: Bearer KEY`")
    args = parser.parse_args()
    if args.converse:
        if args.text or args.image or args.audio:
            parser.error("--converse takes its turns from the files alone")
        return main_converse(args)
    if args.text is None:
        parser.error("the text of the request is required (or --converse FILE)")
    req = request(args.text, [p.read_bytes() for p in args.image], [p.read_bytes() for p in args.audio],
                  speech=args.speech is not None, voice=args.voice, max_tokens=args.max_tokens,
                  max_frames=args.max_frames, temperature=args.temperature)
    try:
        finished = run(args.address, req, args.speech, tls_ca=args.tls_ca, api_key=args.api_key)
    except grpc.RpcError as e:
        sys.exit(f"error: {e.code().name}: {e.details()}")
    print(f"[{omni_pb2.FinishReason.Name(finished.reason)}] {finished.usage.completion_tokens} tokens, "
          f"{finished.usage.audio_seconds:.2f} s of speech", file=sys.stderr)


def main_converse(args) -> None:
    req = request("", speech=args.speech is not None, voice=args.voice, max_tokens=args.max_tokens,
                  max_frames=args.max_frames, temperature=args.temperature)
    settings = omni_pb2.SessionSettings(output_modalities=req.output_modalities, voice=req.voice,
                                        sampling=req.sampling, talker_sampling=req.talker_sampling)
    try:
        done = converse(args.address, [speech_of(p) for p in args.converse], settings, args.speech,
                        tls_ca=args.tls_ca, api_key=args.api_key)
    except grpc.RpcError as e:
        sys.exit(f"error: {e.code().name}: {e.details()}")
    if any(d.status != omni_pb2.TURN_STATUS_COMPLETED for d in done):
        sys.exit(1)


if __name__ == "__main__":
    main()
