"""bench.run's HTTP client mode: the workloads' requests as chat bodies that the api process turns back into the very
same GenerateRequest, and a sweep whose every cell runs through gRPC and then HTTP, counted alike."""

import asyncio

import pytest

from bench import results
from bench import run as bench_run
from bench.http_client import chat_body
from bench.workloads import WORKLOADS, MediaSpec, grpc_request
from services.api.audio_store import AudioStore
from services.api.schema import ChatRequest
from services.api.translate import chat_request


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_workload_body_is_its_grpc_request(name):
    media = MediaSpec(image_size=64, clip_seconds=1.0)
    for index in (0, 7):
        want = grpc_request(WORKLOADS[name], index, media, seed_base=3)
        got = asyncio.run(chat_request(ChatRequest.model_validate(chat_body(want, "m", "ethan")), AudioStore(60), None))
        if WORKLOADS[name].speech:
            want.voice = "ethan"  # OpenAI's API names a voice; the gRPC request leaves the default's name out
        else:
            want.ClearField("audio_format")  # of no use without audio, and not asked for over HTTP
        assert got == want, name


def test_a_sweep_through_both_doors(mesh, api, tmp_path):
    out = tmp_path / "both.json"
    bench_run.main(["--config", str(api.cfg_path), "--address", mesh.gateway_address, "--http", api.url, "--out", str(out),
                    "--workloads", "t2t,t2s", "--concurrency", "1,2", "--min-requests", "2", "--requests-per-slot", "1",
                    "--max-tokens", "4", "--frames", "5", "--prompt-bytes", "16", "--records"])
    cells = {(c["workload"], c["concurrency"], c["client"]): c for c in results.read(out)["cells"]}
    assert set(cells) == {(w, b, d) for w in ("t2t", "t2s") for b in (1, 2) for d in ("grpc", "http")}
    for (w, b, door), cell in cells.items():
        assert cell["status"] == "ok" and cell["failures"] == 0 and cell["length_mismatches"] == 0, (w, b, door, cell["first_error"])
        twin = cells[w, b, "grpc"]
        # The same requests (indices and seeds) through either door: the same tokens and samples.
        assert cell["text_tokens"] == twin["text_tokens"] and cell["audio_s"] == pytest.approx(twin["audio_s"]), (w, b, door)
        assert all(0 < r["ttft"] <= r["end"] - r["start"] for r in cell["records"]), (w, b, door)
        if w == "t2s":
            assert all(r["audio_frames"] == 5 and 0 < r["ttfa"] for r in cell["records"]), (w, b, door)
        assert "api-0" in cell["stage_cpu_frac"], cell["stage_cpu_frac"]  # the api process's CPU, read like every stage's
