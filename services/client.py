"""A small client of the public API: prints the text as it streams, writes the speech to a WAV file.

    python -m services.client "Describe this." [--image a.png] [--audio b.wav] [--speech out.wav] [--address HOST:PORT]
                              [--tls-ca ca.pem] [--api-key KEY]
"""

import argparse
import io
import sys
import wave
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
        req.sampling.temperature = temperature
    if max_frames is not None:
        req.talker_sampling.max_tokens = max_frames
    return req


def run(address: str, req: omni_pb2.GenerateRequest, speech_path: Path | None, out=sys.stdout,
        tls_ca: Path | None = None, api_key: str = "") -> omni_pb2.Finished:
    """One request, streamed; over TLS trusting `tls_ca` when given, with `api_key` as its bearer when given."""
    pcm, rate = bytearray(), 0
    finished = None
    options = [("grpc.max_receive_message_length", 1 << 30)]
    channel = grpc.insecure_channel(address, options) if tls_ca is None else \
        grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca.read_bytes()), options)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    with channel:
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
        speech_path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(speech_path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(bytes(pcm))
    return finished


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
    parser.add_argument("text")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--image", action="append", default=[], type=Path)
    parser.add_argument("--audio", action="append", default=[], type=Path)
    parser.add_argument("--speech", type=Path, default=None, help="ask for speech and write it to this WAV file")
    parser.add_argument("--voice", default="")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--tls-ca", type=Path, default=None, help="the CA to trust: the gateway serves TLS")
    parser.add_argument("--api-key", default="", help="sent as `authorization: Bearer KEY`")
    args = parser.parse_args()
    req = request(args.text, [p.read_bytes() for p in args.image], [p.read_bytes() for p in args.audio],
                  speech=args.speech is not None, voice=args.voice, max_tokens=args.max_tokens)
    try:
        finished = run(args.address, req, args.speech, tls_ca=args.tls_ca, api_key=args.api_key)
    except grpc.RpcError as e:
        sys.exit(f"error: {e.code().name}: {e.details()}")
    print(f"[{omni_pb2.FinishReason.Name(finished.reason)}] {finished.usage.completion_tokens} tokens, "
          f"{finished.usage.audio_seconds:.2f} s of speech", file=sys.stderr)


if __name__ == "__main__":
    main()
