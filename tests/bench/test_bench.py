"""The benchmark harness on the tiny model: a smoke sweep through the launched mesh and through transformers'
generate(), the figures checked against the requests' own counts, the result files read back and reported."""

import json
from pathlib import Path
import statistics

import pytest

from bench import compare, report, results
from bench import run as bench_run
from bench.workloads import WORKLOADS, MediaSpec, ascii_prompt, grpc_request, select
from conftest import write_config

TOKENS, FRAMES, SAMPLES_PER_FRAME = 6, 5, 1920
SMOKE = ["--workloads", "t2t,i2s,s2s", "--concurrency", "1,2", "--min-requests", "2", "--requests-per-slot", "2",
         "--max-tokens", str(TOKENS), "--frames", str(FRAMES), "--prompt-bytes", "16", "--image-size", "64",
         "--clip-seconds", "1", "--records"]


@pytest.fixture(scope="module")
def bench_dir(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    write_config(tmp / "mesh.yaml", tiny_model)
    return tmp


@pytest.fixture(scope="module")
def decoded_tail(tiny_model) -> int:
    """A decode of code2wav falls short of its frames' samples by a fixed tail: measured here, on the tiny model."""
    import torch

    from services.model.load import load_component

    code2wav = load_component("code2wav", tiny_model)
    with torch.no_grad():
        wav = code2wav(torch.zeros(1, code2wav.config.num_quantizers, FRAMES, dtype=torch.long))
    return FRAMES * SAMPLES_PER_FRAME - wav.shape[-1]


@pytest.fixture(scope="module")
def mesh_result(bench_dir):
    out = bench_dir / "mesh.json"
    # The launched mesh runs the native engines, through an override: the stages must read the overridden file.
    bench_run.main(["--config", str(bench_dir / "mesh.yaml"), "--launch", "--log-dir", str(bench_dir / "logs"), "--out", str(out),
                    "--set", "thinker.engine=native", "--set", "talker.engine=native", *SMOKE])
    return out


@pytest.fixture(scope="module")
def hf_result(bench_dir):
    out = bench_dir / "hf.json"
    bench_run.main(["--config", str(bench_dir / "mesh.yaml"), "--engine", "hf", "--device", "cpu", "--out", str(out), *SMOKE])
    return out


def check_sweep(path, engine: str, tail: int) -> dict:
    result = results.read(path)
    assert result == json.loads(path.read_text()) and result["engine"] == engine
    assert result["git_commit"] and result["machine"]["hostname"] and result["machine"]["cpu_count"] > 0
    assert result["config"]["content"]["model"]["path"] and result["model"]["thinker"]["hidden_size"] == 32
    assert "python -m bench.run" in result["run"]["command"]
    cells = {(c["workload"], c["concurrency"]): c for c in result["cells"]}
    assert set(cells) == {(w, b) for w in ("t2t", "i2s", "s2s") for b in (1, 2)}
    for (workload, b), cell in cells.items():
        where = f"{engine} {workload} B={b}"
        speech = WORKLOADS[workload].speech
        recs = cell["records"]
        assert cell["status"] == "ok" and cell["failures"] == 0 and cell["failure_codes"] == {}, (where, cell["first_error"])
        assert cell["requests"] == len(recs) == max(2 * b, 2) and cell["warmup_requests"] == b, where
        assert len({r["index"] for r in recs}) == len(recs), where
        for r in recs:
            latency = r["end"] - r["start"]
            assert r["text_tokens"] == r["usage_tokens"] == TOKENS, where
            assert len(r["itl"]) == r["text_deltas"] - 1 and all(x >= 0 for x in r["itl"]), where
            assert 0 < r["ttft"] <= latency, where
            if speech:
                assert r["audio_frames"] == FRAMES and r["audio_chunks"] >= 1, where
                # Exactly FRAMES frames of 1920 samples less one decode's tail: streamed chunks join without a gap.
                assert r["audio_samples"] == FRAMES * SAMPLES_PER_FRAME - tail, where
                assert 0 < r["ttfa"] <= latency, where
            else:
                assert r["audio_samples"] == 0 and r["ttfa"] is None, where
        latencies = [r["end"] - r["start"] for r in recs]
        audio_s = sum(r["audio_samples"] for r in recs) / 24000
        duration = cell["duration_s"]
        assert cell["text_tokens"] == TOKENS * len(recs) and cell["length_mismatches"] == 0, where
        assert cell["output_tok_per_s"] == pytest.approx(cell["text_tokens"] / duration), where
        assert cell["req_per_s"] == pytest.approx(len(recs) / duration), where
        assert cell["audio_s"] == pytest.approx(audio_s) and cell["audio_s_per_s"] == pytest.approx(audio_s / duration), where
        assert cell["e2e_p50"] == pytest.approx(statistics.median(latencies)) and cell["e2e_p50"] <= cell["e2e_p99"], where
        # Closed loop: never more than B in flight, so the cell lasts at least the sum of latencies / B.
        assert sum(latencies) / b <= duration * 1.001 and max(latencies) <= duration * 1.001, where
        assert cell["ttft_p50"] <= cell["ttft_p99"] and cell["itl_p50"] > 0, where
        if speech:
            rtf = statistics.median(lat / (r["audio_samples"] / 24000) for lat, r in zip(latencies, recs))
            assert cell["rtf_p50"] == pytest.approx(rtf) and cell["ttfa_p50"] <= cell["ttfa_p99"], where
            assert audio_s == pytest.approx(len(recs) * (FRAMES * SAMPLES_PER_FRAME - tail) / 24000), where
        else:
            assert cell["rtf_p50"] is None and cell["audio_s"] == 0, where
        if engine == "mesh":
            assert 0 < cell["client_cpu_frac"] < 1 and cell["messages"] > 0, where
            # The gateway's clock starts after the client's and stops before the client has read the message.
            assert all(0 < r["server_ttft"] <= r["ttft"] for r in recs) and "total" in cell["stage_seconds_p50"], where
            # every stage process's CPU over the cell, from its metrics endpoint (in clock ticks of 10 ms: a short
            # cell may show none; the sweep as a whole shows the gateway and thinker at work)
            cpu = cell["stage_cpu_frac"]
            assert {k.rsplit("-", 1)[0] for k in cpu} == {"gateway", "preprocess", "encoder", "thinker", "talker"}, where
            assert all(v >= 0 for v in cpu.values()), (where, cpu)
    if engine == "mesh":
        for stage in ("gateway-0", "thinker-0"):
            assert sum(c["stage_cpu_frac"][stage] * c["duration_s"] for c in cells.values()) > 0.05, stage
    return result


def test_mesh_sweep(mesh_result, decoded_tail):
    result = check_sweep(mesh_result, "mesh", decoded_tail)
    assert result["run"]["stage_exit_codes"] and all(c == 0 for c in result["run"]["stage_exit_codes"].values())
    assert result["model"]["served"]["model"] == "tiny"
    assert result["config"]["content"]["thinker"]["engine"] == result["config"]["content"]["talker"]["engine"] == "native"
    for stage in ("thinker", "talker"):  # what each stage says it runs, in its log
        assert "engine: native" in (Path(result["run"]["log_dir"]) / f"{stage}-0.log").read_text()


def test_hf_sweep(hf_result, decoded_tail):
    result = check_sweep(hf_result, "hf", decoded_tail)
    assert result["config"]["hf"]["device"] == "cpu"
    assert all("streamer" in c["note"] for c in result["cells"])


def test_engines_get_the_same_requests(mesh_result, hf_result):
    mesh, hf = (results.read(p)["cells"] for p in (mesh_result, hf_result))
    for a, b in zip(mesh, hf):
        assert results.cell_key(a) == results.cell_key(b)
        prompts = [{r["index"]: r["prompt_tokens"] for r in cell["records"]} for cell in (a, b)]
        assert prompts[0] == prompts[1] and all(prompts[0].values()), a["workload"]


def test_report_and_compare(mesh_result, hf_result, capsys):
    written = report.main([str(mesh_result), str(hf_result), "--no-plots"])
    md = written[0].read_text()
    assert written[0] == mesh_result.with_suffix(".md")
    assert "## t2t" in md and "## s2s" in md and "| B=2 |" in md and "x) |" in md and "hf.json" in md
    # where each first output waits, from the stages' own reports: the thinker's queue everywhere, the encoder's
    # with media, the talker's parts with speech
    split = md[md.index("## s2s"):]
    assert "Where s2s's first output waits" in split and "encode_wait" in split and "talker_first_chunk" in split
    assert "CPU of each stage process over s2s's cells" in split and "gateway-0" in split
    text = md[md.index("## t2t"):md.index("## i2s")]
    assert "thinker_wait" in text and "encode_wait" not in text
    rows = compare.main([str(hf_result), str(mesh_result), "--metrics", "output_tok_per_s,ttfa_p50"])
    assert len(rows) == 6 + 4  # tok/s for every cell, TTFA for the speech ones
    out = capsys.readouterr().out
    assert "s2s B=2" in out and "ttfa_p50" in out and out.count("x\n") >= len(rows)


def test_report_plots(mesh_result, hf_result):
    written = report.main([str(mesh_result), str(hf_result)])
    assert [p.name for p in written[1:]] == ["mesh-throughput.png", "mesh-latency.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_time_limit_skips_cells(bench_dir):
    out = bench_dir / "hf-skipped.json"
    bench_run.main(["--config", str(bench_dir / "mesh.yaml"), "--engine", "hf", "--device", "cpu", "--out", str(out),
                    "--max-minutes", "0.00001", *SMOKE])
    cells = results.read(out)["cells"]
    assert len(cells) == 6 and all(c["status"] == "skipped" and "time limit" in c["reason"] for c in cells)


def test_workload_inputs_are_deterministic(tiny_model):
    from transformers import AutoTokenizer

    media = MediaSpec(image_size=64, clip_seconds=1.0, video_seconds=1.0, video_size=(64, 48))
    for w in select("t2t,i2t,s2t,t2s,i2s,s2s,v2t,v2s", max_tokens=7, frames=3):
        a, b, c = (grpc_request(w, i, media) for i in (5, 5, 6))
        assert a.SerializeToString() == b.SerializeToString() != c.SerializeToString(), w.name
        assert a.sampling.max_tokens == 7 and a.sampling.ignore_eos and a.sampling.seed > 0, w.name
        assert not a.sampling.HasField("temperature"), w.name  # the deployment's default, non-greedy sampling
        assert (a.talker_sampling.max_tokens, a.talker_sampling.ignore_eos) == ((3, True) if w.speech else (0, False)), w.name
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert all(len(tokenizer(ascii_prompt(seed, 128))["input_ids"]) == 128 for seed in range(20))


def test_video_workloads_hear_their_clips(bench_dir, mesh):
    """v2t and v2s through a mesh and through transformers' generate(use_audio_in_video=True): each request a
    generated MP4 (H.264, AAC) sent as Video.file with use_audio_in_video, every request answered at its lengths, its
    prompt the same on both engines and holding the clip's sound as well as its frames (more tokens than the same
    file unheard, by the soundtrack's)."""
    from client_util import generate
    from services.model.spec import audio_tokens
    from services.preprocess.media import Preprocessor
    from services.runtime.config import Limits

    out, hf = bench_dir / "video.json", bench_dir / "video-hf.json"
    args = ["--config", str(mesh.config_path), "--records", "--workloads", "v2t,v2s", "--concurrency", "1,2",
            "--min-requests", "2", "--requests-per-slot", "1", "--max-tokens", str(TOKENS), "--frames", str(FRAMES),
            "--video-seconds", "2", "--video-size", "64x48"]
    bench_run.main([*args, "--address", mesh.gateway_address, "--out", str(out)])
    bench_run.main([*args, "--engine", "hf", "--device", "cpu", "--out", str(hf)])
    cells = {c["workload"]: c for c in results.read(out)["cells"] if c["concurrency"] == 2}
    hf_cells = {c["workload"]: c for c in results.read(hf)["cells"] if c["concurrency"] == 2}
    assert set(cells) == set(hf_cells) == {"v2t", "v2s"} and all(c["input"] == "video" for c in cells.values())
    for name, cell in cells.items():
        for c in (cell, hf_cells[name]):
            assert c["status"] == "ok" and c["failures"] == 0, (name, c.get("first_error"))
            assert all(r["text_tokens"] == TOKENS for r in c["records"]), name
            assert all((r["audio_frames"] == FRAMES) == WORKLOADS[name].speech for r in c["records"]), name
        prompts = [{r["index"]: r["prompt_tokens"] for r in c["records"]} for c in (cell, hf_cells[name])]
        assert prompts[0] == prompts[1], name
    media = MediaSpec(video_seconds=2.0, video_size=(64, 48))
    req = grpc_request(select("v2t", max_tokens=TOKENS)[0], 0, media)
    clip = req.messages[0].parts[0].video
    assert clip.use_audio_in_video and clip.file[4:8] == b"ftyp"
    heard = generate(mesh.gateway_address, req).finished.usage.prompt_tokens
    clip.use_audio_in_video = False
    unheard = generate(mesh.gateway_address, req).finished.usage.prompt_tokens
    pre = Preprocessor(mesh.cfg.model.dir, Limits())
    sound = pre.soundtrack(pre.video_file(clip.file, 0.0))
    assert sound.num_tokens == audio_tokens(sound.feature_length) > 20
    assert heard - unheard == 2 + sound.num_tokens  # <|audio_start|>, <|audio_end|> and the sound's tokens
    assert {r["prompt_tokens"] for r in cells["v2t"]["records"]} == {heard}


def test_a_sweep_runs_in_parts(bench_dir):
    """--resume adds the cells a file lacks and keeps the earlier part's; a part that measures something else
    (here: other lengths) is refused and the file left as it was."""
    out = bench_dir / "hf-parts.json"
    args = ["--config", str(bench_dir / "mesh.yaml"), "--engine", "hf", "--device", "cpu", "--out", str(out), "--workloads", "t2t",
            "--min-requests", "2", "--requests-per-slot", "1", "--max-tokens", "3", "--prompt-bytes", "16"]
    bench_run.main([*args, "--concurrency", "1"])
    first = results.read(out)
    bench_run.main([*args, "--concurrency", "1,2", "--resume"])
    both = results.read(out)
    assert [(c["workload"], c["concurrency"], c["status"]) for c in both["cells"]] == [("t2t", 1, "ok"), ("t2t", 2, "ok")]
    assert both["cells"][0] == first["cells"][0]  # not run again
    assert [p["args"]["concurrency"] for p in both["parts"]] == ["1"] and both["run"]["args"]["concurrency"] == "1,2"
    with pytest.raises(SystemExit, match="max_tokens"):
        bench_run.main([*args[:-4], "--max-tokens", "4", "--prompt-bytes", "16", "--concurrency", "4", "--resume"])
    assert results.read(out) == both


def test_parts_run_side_by_side_merge_into_one_file(bench_dir):
    """bench.merge joins files of one sweep's parts run at the same time (say one per GPU) with --resume's checks:
    their cells and run records kept; parts that measure something else, or the same cell twice, refused."""
    from bench import merge

    args = ["--config", str(bench_dir / "mesh.yaml"), "--engine", "hf", "--device", "cpu", "--concurrency", "1",
            "--min-requests", "1", "--requests-per-slot", "1", "--prompt-bytes", "16", "--frames", "2"]
    text, speech, longer = (bench_dir / f"side-{n}.json" for n in ("text", "speech", "longer"))
    bench_run.main([*args, "--max-tokens", "3", "--workloads", "t2t", "--out", str(text)])
    bench_run.main([*args, "--max-tokens", "3", "--workloads", "t2s", "--out", str(speech)])
    bench_run.main([*args, "--max-tokens", "4", "--workloads", "i2t", "--out", str(longer)])
    out = bench_dir / "side-merged.json"
    merged = merge.main([str(text), str(speech), "--out", str(out)])
    assert results.read(out) == merged
    assert [(c["workload"], c["status"]) for c in merged["cells"]] == [("t2t", "ok"), ("t2s", "ok")]
    assert [p["args"]["workloads"] for p in merged["parts"]] == ["t2t"] and merged["run"]["args"]["workloads"] == "t2s"
    # As a baseline in a report: both parts' commands named; a cell of ours that was skipped shows its figures.
    ours = bench_dir / "side-ours.json"
    bench_run.main([*args, "--max-tokens", "3", "--workloads", "t2s", "--out", str(ours), "--max-minutes", "0.00001"])
    md = report.main([str(ours), str(out), "--no-plots"])[0].read_text()
    assert str(text) in md and str(speech) in md
    row = next(line for line in md.splitlines() if line.startswith("| B=1 |"))
    assert "audio-s/s" in md and "- / " in row and "- / -" not in row.split("|")[2], row
    with pytest.raises(SystemExit, match="max_tokens"):
        merge.main([str(text), str(longer), "--out", str(bench_dir / "none.json")])
    with pytest.raises(SystemExit, match="more than one file"):
        merge.main([str(text), str(out), "--out", str(bench_dir / "none.json")])
    # A part cut short by its time limit skips cells; the same cells measured in another part take their place.
    short = bench_dir / "side-short.json"
    bench_run.main([*args, "--max-tokens", "3", "--workloads", "t2t,t2s", "--out", str(short), "--max-minutes", "0.00001"])
    assert {c["status"] for c in results.read(short)["cells"]} == {"skipped"}
    for files in ([short, out], [out, short]):
        joined = merge.main([*map(str, files), "--out", str(bench_dir / "joined.json")])
        assert sorted((c["workload"], c["status"]) for c in joined["cells"]) == [("t2s", "ok"), ("t2t", "ok")], files


def test_a_mesh_started_apart(bench_dir, mesh):
    """--address drives a mesh started on its own (services.launch, kept up between parts of a sweep);
    --wait-ready waits for every replica of the config to serve (not the gateway alone, which serves before
    the stages behind it have loaded), and gives up on one that never answers, naming it."""
    import time

    out = bench_dir / "apart.json"
    common = ["--config", str(mesh.config_path), "--workloads", "t2t", "--concurrency", "1", "--min-requests", "1",
              "--requests-per-slot", "1", "--max-tokens", "3", "--prompt-bytes", "16"]
    bench_run.main([*common, "--address", mesh.gateway_address, "--wait-ready", "30", "--out", str(out)])
    cells = results.read(out)["cells"]
    assert [(c["workload"], c["status"], c["failures"]) for c in cells] == [("t2t", "ok", 0)]
    from conftest import free_ports

    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="cannot reach the gateway"):
        bench_run.main([*common, "--address", f"127.0.0.1:{free_ports(1)[0]}", "--wait-ready", "2", "--out", str(bench_dir / "none.json")])
    assert 2 <= time.perf_counter() - t0 < 30

    import yaml

    raw = yaml.safe_load(open(mesh.config_path))
    raw["thinker"]["replicas"][0]["port"] = free_ports(1)[0]  # a thinker that never comes up
    missing = bench_dir / "no-thinker.yaml"
    missing.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit, match=r"not serving after 2s: thinker\[0\] at 127.0.0.1:"):
        bench_run.main([*common[:1], str(missing), *common[2:], "--address", mesh.gateway_address, "--wait-ready", "2",
                        "--out", str(bench_dir / "none.json")])


def test_a_dead_stage_skips_only_the_cells_that_need_it():
    """The sweep of session 7 lost every cell, text ones too, to a talker that had died: a stage's death now
    skips only the workloads whose requests pass through it."""
    from types import SimpleNamespace

    from bench.run import dead_stages
    from bench.workloads import WORKLOADS

    def proc(code):
        return SimpleNamespace(poll=lambda: code, returncode=code)

    procs = {"gateway-0": proc(None), "preprocess-0": proc(None), "encoder-0": proc(None), "encoder-1": proc(None),
             "thinker-0": proc(None), "talker-0": proc(-6)}
    assert {name: bool(dead_stages(procs, w)) for name, w in WORKLOADS.items()} == {
        "t2t": False, "i2t": False, "s2t": False, "t2s": True, "i2s": True, "s2s": True, "v2t": False, "v2s": True}
    assert dead_stages(procs, WORKLOADS["s2s"]) == "talker-0 exited with code -6"
    procs["encoder-1"] = proc(1)
    assert [n for n, w in WORKLOADS.items() if dead_stages(procs, w)] == ["i2t", "s2t", "t2s", "i2s", "s2s", "v2t", "v2s"]
    procs["thinker-0"] = proc(1)
    assert all(dead_stages(procs, w) for w in WORKLOADS.values())
