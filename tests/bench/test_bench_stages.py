"""bench.stages and its neighbours on the tiny model: each stage's cells (thinker, talker, code2wav, transformers'
thinker), their modes on one engine, the host's step by phase, a tile shape tried in place of the code's, the
experts a step reads, and bench.profile_step's profiles and device timeline."""

import json
import os

import pytest
import torch

from bench import code2wav, report, results, routing, stages
from conftest import write_config


@pytest.fixture(scope="module")
def bench_dir(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-stages")
    write_config(tmp / "mesh.yaml", tiny_model)
    return tmp


def test_stage_benchmarks(bench_dir):
    out = bench_dir / "stages.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--batches", "1,2", "--prompt-lens", "16",
                 "--decode-steps", "3", "--frames", "4", "--encoder-batches", "1,2", "--image-size", "64",
                 "--clip-seconds", "1", "--preprocess-items", "2"])
    cells = results.read(out)["cells"]
    by = {results.cell_key(c): c for c in cells}
    for b in (1, 2):
        decode = by[(("stage", "thinker"), ("mode", "decode"), ("batch", b), ("prompt_len", 16))]
        assert decode["tok_per_s"] == pytest.approx(b * 3 / decode["seconds"]) and decode["host_ms_per_step"] > 0
        assert decode["launch_ms_per_step"] is None  # the reference engine counts no graph launches
        talker = by[(("stage", "talker"), ("mode", "decode"), ("batch", b))]
        assert talker["frames"] == 4 * b and sum(talker[f"{k}_share"] for k in ("talker", "code_predictor", "code2wav")) == pytest.approx(1)
        # the decode steps' own frames: each request's first frame came with its prompt's steps
        assert 0 < talker["decode_frames"] <= 3 * b
        assert talker["frames_per_s"] == pytest.approx(talker["decode_frames"] / talker["seconds"])
        # each decode step's wall time: its spread, and the slowest steps by index
        assert 0 < talker["step_ms_p50"] <= talker["step_ms_p90"] <= talker["step_ms_max"]
        assert talker["step_ms_max"] <= 1000 * talker["seconds"] and all(0 <= i < talker["steps"] for i in talker["slowest_steps"])
        assert talker["gc_passes"] >= 0 and 0 <= talker["gc_max_ms"] <= talker["gc_ms"] <= 1000 * talker["seconds"]
        # the host thread's CPU time a step outside its waits, within the step's wall time
        assert 0 < talker["host_cpu_ms_per_step"] <= talker["step_ms"] * 1.01, talker
        for item in ("image", "audio"):
            assert by[(("stage", "encoder"), ("item", item), ("batch", b))]["items_per_s"] > 0
    assert report.main([str(out)])[0].read_text().count("## ") == 5


def test_talker_modes_share_one_engine(bench_dir):
    """--talker-modes measures each batch plain and overlapped on one native talker (one build): the same
    frames either way, each cell named by its mode; a mode the engine lacks is refused by name."""
    out = bench_dir / "talker-modes.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "talker", "--batches", "2",
                 "--frames", "5", "--talker-modes", "plain,overlap,overlap-c2w-inline", "--set", "talker.engine=native"])
    cells = results.read(out)["cells"]
    assert [c["mode"] for c in cells] == ["decode plain", "decode overlap", "decode overlap-c2w-inline"]
    assert all(c["frames"] == 10 and c["steps"] > 0 for c in cells)
    assert [c["overlapped_steps"] > 0 for c in cells] == [False, True, True]
    for c in cells:  # the native talker's host phases a step: each one its steps pass through, within the step
        split = c["host_split_ms"]
        assert {"admit", "inputs", "schedule", "sample", "launch", "queue", "read", "vocode"} <= set(split), split
        assert all(v >= 0 for v in split.values()) and sum(split.values()) <= c["step_ms"] * 1.01, (split, c["step_ms"])
    with pytest.raises(SystemExit, match="no such switches"):
        stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(bench_dir / "none.json"), "--stages", "talker",
                     "--batches", "1", "--frames", "2", "--talker-modes", "overlap"])


def test_native_thinker_cells_split_the_hosts_step_by_phase(bench_dir):
    """The native thinker's decode cells give the host's ms a step by phase (its laps), each phase its overlapped
    steps pass through present, none negative, all of them within the step; its CPU ms a step; and the host's p90."""
    out = bench_dir / "thinker-laps.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "thinker", "--batches", "2",
                 "--prompt-lens", "8", "--decode-steps", "8", "--set", "thinker.engine=native", "--set", "thinker.overlap=true"])
    decode = next(c for c in results.read(out)["cells"] if c["mode"] == "decode")
    split = decode["host_split_ms"]
    assert {"schedule", "queue", "finish", "rest"} <= set(split), split
    assert all(v >= 0 for v in split.values()) and sum(split.values()) <= decode["step_ms"] * 1.01, (split, decode["step_ms"])
    # and the thread's CPU time a step outside its waits (no more than the step's wall time), with what took the CPU
    # from it where Linux tells: involuntary switches, the hypervisor's steal
    assert 0 < decode["host_cpu_ms_per_step"] <= decode["step_ms"] * 1.01, decode
    assert decode.get("involuntary_switches_per_step", 0) >= 0 and 0 <= decode.get("steal_pct", 0) <= 100, decode
    # and what shares the machine with it: the process's other threads' CPU (reported), the busy CPUs (at least this
    # one's share, below)
    assert "other_threads_cpu_ms_per_step" in decode, decode
    # and a fixed piece of interpreter work's time before the cell and between its steps (the CPU's own speed)
    assert decode["cpu_probe_idle_us"] > 0 and decode["cpu_probe_us"] > 0, decode
    if "busy_cpus" in decode:
        assert 0 < decode["busy_cpus"] <= (os.cpu_count() or 1) + 0.01, decode
    # and the slowest tenth's bound beside the median
    assert decode["host_ms_p90"] >= decode["host_ms_per_step"] > 0, decode


def test_moe_tiles_replace_the_decode_kernels_shape_between_17_and_64_tokens(monkeypatch):
    """--moe-tiles: the given shape (a bench.moe list entry, its time dropped) for 17 to 64 tokens, the code's own
    elsewhere; a shape with keys the kernels lack is refused."""
    from services.llm import triton_moe

    monkeypatch.setattr(triton_moe, "_tiles", triton_moe._tiles)  # put back after the test
    shape = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2, "down": {"BLOCK_N": 128}}
    default = triton_moe._tiles(8)
    stages.use_moe_tiles(shape)
    assert triton_moe._tiles(32) == shape and triton_moe._tiles(17) == shape and triton_moe._tiles(64, True, True) == shape
    assert triton_moe._tiles(8) == default and triton_moe._tiles(16) == default and triton_moe._tiles(65)["BLOCK_K"] == 128
    with pytest.raises(SystemExit, match="BLOCK_Q"):
        stages.use_moe_tiles({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_Q": 1})
    args = stages.parse_args(["--config", "x.yaml", "--out", "y.json", "--moe-tiles", json.dumps({**shape, "ms": 0.25})])
    assert args.moe_tiles["ms"] == 0.25  # dropped by use_moe_tiles
    stages.use_moe_tiles(args.moe_tiles)
    assert triton_moe._tiles(32) == shape


@pytest.mark.parametrize("stage", ["thinker", "talker", "thinker-prefill"])
def test_step_profiles(bench_dir, stage, capsys):
    """bench.profile_step prints the host's profile and torch.profiler's table for a stage's steps (native engines);
    thinker-prefill's steps are fresh requests taken to their first token, freed after (the KV cache ends empty)."""
    from bench import profile_step

    engine = profile_step.main(["--config", str(bench_dir / "mesh.yaml"), "--stage", stage, "--batch", "2",
                                "--prompt-len", "8", "--steps", "2", "--rows", "5", "--set", f"{stage.split('-')[0]}.engine=native"])
    out = capsys.readouterr().out
    assert "function calls" in out and "Self CPU" in out, out[-2000:]
    if stage == "thinker-prefill":
        assert "prefill of 2 x 8 tokens to the first token" in out
        assert engine.n == 6 and len(engine.walls) == 6  # warm, under cProfile, under torch.profiler: 2 rounds each
        assert engine.engine.scheduler.allocator.used == 0


def test_device_timeline_unions_each_stream_and_all_of_them():
    """bench.profile_step's timeline: stream 7 busy 0-10 and 5-12 (12), stream 9 busy 11-20 and 30-31 (10); the
    span 0-31, something running 0-20 and 30-31 (21 of 31), the streams' busy times summed 22 (1 side by side)."""
    from bench.profile_step import timeline

    t = timeline([(7, 5, 12), (9, 11, 20), (7, 0, 10), (9, 30, 31)])
    assert t["streams"] == {7: {"busy": 12, "activities": 2}, 9: {"busy": 10, "activities": 2}}
    assert (t["span"], t["busy"], t["busy_sum"]) == (31, 21, 22)
    assert timeline([]) == {"streams": {}, "span": 0, "busy": 0, "busy_sum": 0}
    assert timeline([(1, 0, 4), (1, 1, 2), (1, 4, 6)])["busy"] == 6  # one inside another, one touching


def test_transformers_thinker_stage(bench_dir):
    out = bench_dir / "hf-stages.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "hf-thinker", "--hf-batches", "1,2",
                 "--prompt-lens", "16", "--decode-steps", "3", "--device", "cpu"])
    by = {(c["mode"], c["batch"]): c for c in results.read(out)["cells"]}
    for b in (1, 2):
        decode = by["decode", b]
        assert decode["engine"] == "transformers-generate" and decode["steps"] == 3
        assert decode["tok_per_s"] == pytest.approx(b * 3 / decode["seconds"]) and by["prefill", b]["seconds"] > 0


def test_code2wav_precisions_against_float32(bench_dir):
    """bench.stages --stages code2wav: each streaming chunk shape and batch in float32, bfloat16, float32 with
    its activations fused and float32 with its decoder native, on the same codes; float32 is the reference (no
    error), bfloat16 a small but nonzero one, fused and native float32 all but none, and the report shows them."""
    out = bench_dir / "code2wav.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "code2wav", "--batches", "1,2",
                 "--decode-steps", "2", "--device", "cpu", "--code2wav-dtypes", "bfloat16,float32+fuse,float32+native"])
    cells = results.read(out)["cells"]
    assert {c["mode"] for c in cells} == {"float32", "bfloat16", "float32+fuse", "float32+native"}
    assert {c["batch"] for c in cells} == {1, 2}
    assert {c["item"] for c in cells} == {"4 frames", "12 frames", "20 frames", "28 frames", "33 frames"}  # the tiny
    # config's chunks: 4 frames, then 8 with every frame before them as context, up to 25
    for c in cells:
        assert c["audio_s_per_s"] > 0 and c["step_ms"] > 0
        if c["mode"] == "float32":
            assert c["rel_l2"] == 0 and c["snr_db"] is None
        elif c["mode"] in ("float32+fuse", "float32+native"):  # the same float32 arithmetic: rounding apart (and
            # not none: it ran)
            assert 0 < c["rel_l2"] < 1e-5, c
        else:
            assert 0 < c["rel_l2"] < 0.1 and c["snr_db"] > 20, c
    assert "SNR dB" in report.main([str(out)])[0].read_text()
    with pytest.raises(SystemExit, match="unknown precision 'bfloat16\\+fast'"):
        stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "code2wav", "--batches", "1",
                     "--device", "cpu", "--code2wav-dtypes", "bfloat16+fuse+tune,bfloat16+fast"])
    with pytest.raises(SystemExit, match="unknown precision 'bfloat16\\+fuse\\+native'"):
        stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "code2wav", "--batches", "1",
                     "--device", "cpu", "--code2wav-dtypes", "bfloat16+fuse+native"])


def test_tuned_convolutions_time_them_inside_only():
    """code2wav's "+tune": cuDNN times convolutions inside the block (while graphs are captured) and goes back to
    what it did before after it, an error raised inside included."""
    before = torch.backends.cudnn.benchmark
    for outer in (False, True):
        torch.backends.cudnn.benchmark = outer
        try:
            with code2wav.tuned_convolutions():
                assert torch.backends.cudnn.benchmark
            assert torch.backends.cudnn.benchmark is outer
            with pytest.raises(RuntimeError), code2wav.tuned_convolutions():
                raise RuntimeError("capture failed")
            assert torch.backends.cudnn.benchmark is outer
        finally:
            torch.backends.cudnn.benchmark = before


def test_thinker_modes_share_one_engine(bench_dir):
    """--thinker-modes measures each batch's decode plain and overlapped on one native thinker (one prefill
    cell, it is the same in both); a mode the engine lacks is refused by name."""
    out = bench_dir / "thinker-modes.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "thinker", "--batches", "2",
                 "--prompt-lens", "8", "--decode-steps", "3", "--thinker-modes", "plain,overlap,overlap-eager-draw",
                 "--set", "thinker.engine=native"])
    cells = results.read(out)["cells"]
    assert [c["mode"] for c in cells] == ["prefill", "decode plain", "decode overlap", "decode overlap-eager-draw"]
    assert all(c["tok_per_s"] > 0 for c in cells)
    # the native engine counts its steps' time in launching graphs: none on the CPU (the H200 measures it)
    assert all(c["launch_ms_per_step"] == 0 for c in cells[1:])
    with pytest.raises(SystemExit, match="no such switch"):
        stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(bench_dir / "none.json"), "--stages", "thinker",
                     "--batches", "1", "--prompt-lens", "8", "--decode-steps", "2", "--thinker-modes", "overlap"])


def test_thinker_stage_with_chat_prompts_counts_the_experts_a_step_reads(bench_dir, tiny_model):
    """--prompts chat: the t2t workload's text in the chat template, cut to the prompt length with the template's
    end kept; --routing-stats: how many experts a decode step of the batch chose per layer (the native engine's
    eager steps on the CPU): exactly top-k for one request, between top-k and all of them for several."""
    from transformers import AutoTokenizer

    from services.model.load import load_config
    from services.runtime.config import load_config as load_mesh_config

    text = load_config(tiny_model).thinker_config.text_config
    out = bench_dir / "routing.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "thinker", "--batches", "1,4",
                 "--prompt-lens", "24", "--decode-steps", "2", "--prompts", "chat", "--routing-stats",
                 "--set", "thinker.engine=native"])
    by = {results.cell_key(c): c for c in results.read(out)["cells"]}
    one = by[(("stage", "thinker"), ("mode", "decode"), ("batch", 1), ("prompt_len", 24))]["experts_touched"]
    assert one["min"] == one["max"] == text.num_experts_per_tok and one["layer_steps"] == 4 * text.num_hidden_layers
    assert one["by_layer"] == [text.num_experts_per_tok] * text.num_hidden_layers
    four = by[(("stage", "thinker"), ("mode", "decode"), ("batch", 4), ("prompt_len", 24))]["experts_touched"]
    assert text.num_experts_per_tok <= four["min"] <= four["max"] <= min(text.num_experts, 4 * text.num_experts_per_tok)
    cfg = load_mesh_config(bench_dir / "mesh.yaml")
    ids = routing.chat_prompts(cfg, 0)(3, 24)
    end = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template([{"role": "user", "content": "x"}],
                                                                        add_generation_prompt=True, tokenize=True)
    end = end if isinstance(end, list) else end["input_ids"]
    assert len(ids) == 24 and ids[-3:].tolist() == end[-3:]  # the assistant's opening, last
    assert not torch.equal(ids, routing.chat_prompts(cfg, 0)(4, 24))  # each request its own text


def test_hostprof_times_the_native_thinkers_step_by_function_and_puts_it_back(bench_dir):
    """bench.hostprof: the engine's step pieces timed inclusively (a step holds its schedule), counted per call, and
    the functions themselves again once the run is over."""
    from bench import hostprof
    from services.llm.scheduler import Scheduler
    from services.thinker.engine import NativeThinker

    step, schedule = NativeThinker.step, Scheduler.schedule
    out = bench_dir / "hostprof.json"
    hostprof.main(["--out", str(out), "--", "--config", str(bench_dir / "mesh.yaml"), "--out", str(bench_dir / "hp.json"),
                   "--stages", "thinker", "--batches", "2", "--prompt-lens", "8", "--decode-steps", "4",
                   "--set", "thinker.engine=native", "--set", "thinker.overlap=true"])
    f = json.loads(out.read_text())["functions"]
    assert f["NativeThinker.step"]["calls"] == f["Scheduler.schedule"]["calls"] >= 4
    assert f["NativeThinker.step"]["us_per_call"] > f["Scheduler.schedule"]["us_per_call"] > 0
    assert NativeThinker.step is step and Scheduler.schedule is schedule


def test_host_path_bench_times_the_captured_steps_host_work(tiny_model, tmp_path, monkeypatch):
    """bench.hostpath: the captured, overlapped, mapped decode path on the CPU stand-ins, every step a replay after
    the first few (the graphs' replay count grows by the steps), each phase of the host's step timed."""
    from bench import hostpath

    out = hostpath.main(["--rows", "6", "--steps", "40", "--rounds", "2", "--staggered", "--prompt-len", "100",
                         "--model", str(tiny_model), "--out", str(tmp_path / "hostpath.json")], monkeypatch)
    assert out["steps"] == 40 and out["prompt_len"] == 100 and out["host_ms_per_step"] > 0
    assert {"schedule", "inputs", "plan", "launch", "queue", "finish"} <= set(out["host_split_ms"])
    assert all(v > 0 for v in out["host_split_ms"].values())
    assert json.loads((tmp_path / "hostpath.json").read_text()) == out
