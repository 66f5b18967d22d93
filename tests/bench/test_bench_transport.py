"""bench.transport's rounds between two real processes, on the CPU (its CUDA IPC cells run on the H200s)."""

import pytest

from bench.transport import CFG, SIZES, main, measure


@pytest.mark.parametrize("spin", [False, True])
def test_a_cell_times_every_round_between_two_processes(spin):
    cell = measure(CFG, "cpu", "cpu", SIZES["8KB"], False, reps=4, spin=spin)
    assert cell["reps"] == 4 and cell["bytes"] == 8192
    assert 0 < cell["put_us"] < 1e6 and 0 < cell["get_us"] < 1e6 and 0 < cell["message_us"] < 1e6
    assert cell["ready_us"] == pytest.approx(cell["put_us"] + cell["get_us"])


def test_unknown_waits_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "t.json"), "--waits", "nap"])
