"""The mesh at full size on the GPU(s): real Qwen3-Omni shapes, seeded random weights, bf16, every path."""

import time

import pytest
import torch
import yaml

from client_util import generate
from conftest import free_ports
from references import Case, png, wav

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def full_mesh(tmp_path_factory):
    from services.launch import Mesh
    from services.model.build import build_full_skeleton

    tmp = tmp_path_factory.mktemp("full")
    model = build_full_skeleton(tmp / "model")
    ports = iter(free_ports(24))
    gpus = torch.cuda.device_count()
    second = "cuda:1" if gpus > 1 else "cuda:0"

    def replica(device="cpu", **extra):
        return {"port": next(ports), "metrics_port": next(ports), "device": device, **extra}

    cfg = {
        "model": {"path": str(model), "load_format": "random", "dtype": "bfloat16", "name": "full-random"},
        "transport": {"pool_bytes": 1 << 30},
        "gateway": {"replicas": [replica()]},
        "preprocess": {"replicas": [replica()]},
        "encoder": {"replicas": [replica("cuda:0", prefer_for=["audio"]), replica(second, prefer_for=["text"])]},
        "thinker": {"replicas": [replica("cuda:0")], "kv_blocks": 4096},  # sized by hand: the GPU may be shared
        "talker": {"replicas": [replica(second)], "kv_blocks": 2048},
    }
    (tmp / "mesh.yaml").write_text(yaml.safe_dump(cfg))
    mesh = Mesh(tmp / "mesh.yaml", log_dir=tmp / "logs")
    t0 = time.monotonic()
    mesh.start(timeout=900)
    print(f"full-size mesh on {gpus} GPU(s) healthy after {time.monotonic() - t0:.0f} s")
    yield mesh
    mesh.stop()


PATHS = {
    "t2t": (Case([("user", [("text", "Tell me about the sea.")])]), False),
    "i2t": (Case([("user", [("image", png(1, 512, 512)), ("text", "Describe it.")])]), False),
    "s2t": (Case([("user", [("audio", wav(2, 7.0)), ("text", "What is said?")])]), False),
    "t2s": (Case([("user", [("text", "Say hello.")])]), True),
    "i2s": (Case([("user", [("image", png(3, 512, 512)), ("text", "Describe it aloud.")])]), True),
    "s2s": (Case([("user", [("audio", wav(4, 7.0))])]), True),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_at_full_size(full_mesh, path):
    case, speech = PATHS[path]
    req = case.request(speech=speech, max_tokens=16, frames=12, greedy=False)
    req.sampling.ignore_eos = req.talker_sampling.ignore_eos = True
    req.sampling.seed = req.talker_sampling.seed = 1
    t0 = time.perf_counter()
    res = generate(full_mesh.gateway_address, req, timeout=600)
    elapsed = time.perf_counter() - t0
    u = res.finished.usage
    assert len(res.token_ids) == u.completion_tokens == 16
    if speech:
        assert u.audio_frames == len(res.codes) == 12 and len(res.codes[0]) == 16
        assert u.audio_seconds == pytest.approx(res.samples / 24000) and res.samples > 0
    timings = {t.stage: round(t.seconds, 3) for t in u.timings}
    print(f"{path}: {elapsed:.2f} s, prompt {u.prompt_tokens} tokens, ttft {u.time_to_first_token_seconds:.3f} s, "
          f"ttfa {u.time_to_first_audio_seconds:.3f} s, {timings}")
