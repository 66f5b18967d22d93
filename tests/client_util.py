"""Calling the mesh over its public API from tests, and reading the stages' /metrics."""

import re
import urllib.request
from dataclasses import dataclass, field

import grpc
import numpy as np

from omni.v1 import omni_pb2, omni_pb2_grpc


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pcm: list[np.ndarray] = field(default_factory=list)  # per chunk, float in [-1, 1]
    chunk_codes: list[list[list[int]]] = field(default_factory=list)  # per chunk, frames x codebooks
    finished: omni_pb2.Finished | None = None
    events: list[str] = field(default_factory=list)

    @property
    def codes(self) -> list[list[int]]:
        return [frame for chunk in self.chunk_codes for frame in chunk]

    @property
    def samples(self) -> int:
        return sum(len(p) for p in self.pcm)


def generate(address: str, req: omni_pb2.GenerateRequest, timeout: float | None = 120) -> Result:
    out = Result()
    with grpc.insecure_channel(address) as channel:
        for resp in omni_pb2_grpc.OmniStub(channel).Generate(req, timeout=timeout):
            kind = resp.WhichOneof("event")
            out.events.append(kind)
            if kind == "text":
                out.text += resp.text.text
                out.token_ids += resp.text.token_ids
            elif kind == "audio":
                a = resp.audio
                out.pcm.append(np.frombuffer(a.data, "<i2").astype(np.float32) / 32767.0)
                g = a.num_codebooks or 1
                out.chunk_codes.append([list(a.codec_codes[i:i + g]) for i in range(0, len(a.codec_codes), g)])
            else:
                out.finished = resp.finished
    return out


def error_of(address: str, req, timeout: float = 60) -> grpc.RpcError | None:
    try:
        generate(address, req, timeout)
    except grpc.RpcError as e:
        return e
    return None


def scrape(port: int) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(port: int, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for key, value in scrape(port).items():
        m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
        if m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total
