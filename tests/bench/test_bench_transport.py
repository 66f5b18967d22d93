"""bench.transport's rounds between two real processes, on the CPU (its CUDA IPC cells run on the H200s)."""

import json

import pytest

from bench.transport import SIZES, main, measure


def test_a_cell_times_every_round_between_two_processes():
    cell = measure("cpu", "cpu", SIZES["8KB"], False, reps=4)
    assert cell["reps"] == 4 and cell["bytes"] == 8192
    assert 0 < cell["put_us"] < 1e6 and 0 < cell["get_us"] < 1e6 and 0 < cell["message_us"] < 1e6
    assert cell["ready_us"] == pytest.approx(cell["put_us"] + cell["get_us"])


def test_a_run_writes_a_cell_for_each_size_and_transport(tmp_path):
    out = tmp_path / "t.json"
    main(["--out", str(out), "--device", "cpu", "--reps", "2", "--sizes", "8KB", "--transports", "bytes"])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["route"], c["size"], c["transport"]) for c in cells] == [("same GPU", "8KB", "protobuf bytes")]
