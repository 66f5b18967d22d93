"""bench.stages and bench.profile_step on the tiny model: each stage's cells (thinker, talker, code2wav, encoder,
preprocess, transformers' thinker), the host's step by phase, and the step profiles with their device timeline."""

import pytest

from bench import report, results, stages
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
                 "--clip-seconds", "1", "--preprocess-items", "2", "--video-seconds", "2", "--video-size", "96x64"])
    cells = results.read(out)["cells"]
    by = {results.cell_key(c): c for c in cells}
    for b in (1, 2):
        decode = by[(("stage", "thinker"), ("mode", "decode"), ("batch", b), ("prompt_len", 16))]
        assert decode["tok_per_s"] == pytest.approx(b * 3 / decode["seconds"]) and decode["steps"] == 3
        assert by[(("stage", "thinker"), ("mode", "prefill"), ("batch", b), ("prompt_len", 16))]["tok_per_s"] > 0
        talker = by[(("stage", "talker"), ("mode", "decode"), ("batch", b))]
        assert talker["frames"] == 4 * b and sum(talker[f"{k}_share"] for k in ("talker", "code_predictor", "code2wav")) == pytest.approx(1)
        # the decode steps' own frames (a request's first may come with its prompt's steps, or be read by the first
        # decode step where the step that made it was overlapped)
        assert 0 < talker["decode_frames"] <= 4 * b
        assert talker["frames_per_s"] == pytest.approx(talker["decode_frames"] / talker["seconds"])
        assert 0 < talker["step_ms_p50"] <= talker["step_ms_max"] <= 1000 * talker["seconds"]
        for item in ("image", "audio"):
            assert by[(("stage", "encoder"), ("item", item), ("batch", b))]["items_per_s"] > 0
    pre = {c["item"]: c for c in cells if c["stage"] == "preprocess"}
    assert set(pre) == {"image", "audio", "video"}
    assert pre["video"]["ms_per_media_second"] == pytest.approx(pre["video"]["step_ms"] / 2)
    assert pre["audio"]["ms_per_media_second"] == pytest.approx(pre["audio"]["step_ms"] / 1)
    assert report.main([str(out)])[0].read_text().count("## ") == 5


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_native_cells_split_the_hosts_step_by_phase(bench_dir, stage):
    """A native engine's cells give the host's ms a step by phase (its laps): each phase its steps pass through
    present, none negative, all of them within the step; the host's own ms a step is every phase but the wait."""
    out = bench_dir / f"{stage}-laps.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", stage, "--batches", "2",
                 "--prompt-lens", "8", "--decode-steps", "8", "--frames", "6", "--set", f"{stage}.engine=native"])
    decode = next(c for c in results.read(out)["cells"] if c["mode"] == "decode")
    split = decode["host_split_ms"]
    phases = {"schedule", "rest"} if stage == "thinker" else {"schedule", "sample", "launch"}
    assert phases <= set(split), split
    assert all(v >= 0 for v in split.values()) and sum(split.values()) <= decode["step_ms"] * 1.01, (split, decode["step_ms"])
    assert decode["host_ms_per_step"] == pytest.approx(sum(v for k, v in split.items() if k != "wait"))


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
        assert "prefill of 2 x 8 tokens to the first token" in out and "over 2 rounds" in out
        assert engine.scheduler.allocator.used == 0


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
    """bench.stages --stages code2wav: each chunk shape and batch in float32, bfloat16 and float32 with its decoder
    native, on the same codes; float32 is the reference (no error), bfloat16 a small but nonzero one, native float32
    all but none, and the report shows them."""
    out = bench_dir / "code2wav.json"
    stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "code2wav", "--batches", "1,2",
                 "--decode-steps", "2", "--device", "cpu", "--code2wav-dtypes", "bfloat16,float32+native",
                 "--code2wav-frames", "4,8", "--code2wav-context", "3"])
    cells = results.read(out)["cells"]
    assert {c["mode"] for c in cells} == {"float32", "bfloat16", "float32+native"}
    assert {c["batch"] for c in cells} == {1, 2}
    assert {c["item"] for c in cells} == {"7 frames", "11 frames"}  # each chunk's new frames after 3 of context
    for c in cells:
        assert c["audio_s_per_s"] > 0 and c["step_ms"] > 0
        if c["mode"] == "float32":
            assert c["rel_l2"] == 0 and c["snr_db"] is None
        elif c["mode"] == "float32+native":  # the same float32 arithmetic: rounding apart (and not none: it ran)
            assert 0 < c["rel_l2"] < 1e-5, c
        else:
            assert 0 < c["rel_l2"] < 0.1 and c["snr_db"] > 20, c
    assert "SNR dB" in report.main([str(out)])[0].read_text()
    with pytest.raises(SystemExit, match="unknown precision 'bfloat16\\+fast'"):
        stages.main(["--config", str(bench_dir / "mesh.yaml"), "--out", str(out), "--stages", "code2wav", "--batches", "1",
                     "--device", "cpu", "--code2wav-dtypes", "bfloat16+native,bfloat16+fast"])
