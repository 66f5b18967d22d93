"""Host values for the device (services.llm.host): lists converted through numpy give what torch.tensor gives."""

import numpy as np
import pytest
import torch

from services.llm.host import StepInputs, _from_lists, upload, upload_into

CASES = [([1, 2, 3], None), ([[1, 2], [3, 4]], torch.int32), ([1.5, 2.0], None), ([0.1, 0.7], torch.float32),
         ([True, False], None), ([], torch.int32), ([], None), ([[]], torch.long), ([2**62, -5], torch.long),
         ([1, 2.5], None), ([3.25], torch.bfloat16), ([0.1], torch.float64), ([[0.5, 1], [2, 3]], torch.float16)]


@pytest.mark.parametrize("values,dtype", CASES)
def test_lists_become_what_torch_tensor_makes(values, dtype):
    want, got = torch.tensor(values, dtype=dtype), _from_lists(values, dtype, pin=False)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("values,dtype", [([2**40], torch.int32), ([2**63], None), ([2**64], None), ([[1], [2, 3]], torch.long),
                                          (["a"], torch.long)])
def test_impossible_values_are_refused_as_torch_refuses_them(values, dtype):
    with pytest.raises(Exception) as want:
        torch.tensor(values, dtype=dtype)
    with pytest.raises((want.type, OverflowError, ValueError)):  # numpy's word for the same (overflow, shape, type)
        _from_lists(values, dtype, pin=False)


def test_uploads_on_the_cpu():
    dst = torch.zeros(2, 3, dtype=torch.long)
    upload_into(dst, [[1, 2, 3], [4, 5, 6]])
    assert dst.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert upload([0.5, 1.5], torch.device("cpu")).dtype == torch.get_default_dtype()
    assert upload(torch.arange(3), torch.device("cpu"), torch.int32).dtype == torch.int32
    # a transposed numpy view (code2wav's codes, rows x frames x groups, sent as rows x groups x frames)
    codes = [[[10 * f + g for g in range(2)] for f in range(3)] for _ in range(2)]
    dst = torch.zeros(2, 2, 3, dtype=torch.long)
    upload_into(dst, np.asarray(codes, dtype=np.int64).transpose(0, 2, 1))
    assert torch.equal(dst, torch.tensor(codes).transpose(1, 2))


def test_laps_charge_each_phase_its_time_less_the_waits_inside_it(monkeypatch):
    """Clock reads 0, 1, 4, 10 (start, lap, lap, lap) with a wait of 2 inside the second phase: schedule 1,
    launch 3 - 2 = 1, finish 6, wait 2; per step over two steps, half of each."""
    from services.llm import host

    clock = iter([0.0, 0.0, 1.0, 4.0, 10.0])
    monkeypatch.setattr(host.time, "perf_counter", lambda: next(clock))
    laps = host.Laps()
    laps.start()
    laps.lap("schedule")
    laps.waited(2.0)
    laps.lap("launch")
    laps.lap("finish")
    assert laps.seconds == {"schedule": 1.0, "wait": 2.0, "launch": 1.0, "finish": 6.0}
    assert host.laps_per_step({"finish": 2.0}, laps.seconds, 2) == {"schedule": 500.0, "wait": 1000.0, "launch": 500.0,
                                                                    "finish": 2000.0}


def test_step_inputs_send_both_kinds_of_rows_by_one_copy_from_staging_buffers_used_in_turn():
    """What the host writes into fill()'s views lands in `ints` and `floats` with send(), whose device views keep
    their addresses (a graph reads them); the two staging buffers alternate, each keeping what it last sent."""
    inputs = StepInputs(3, 2, 4, torch.device("cpu"))
    addresses = inputs.ints.data_ptr(), inputs.floats.data_ptr()
    ints, floats = inputs.fill()
    ints[:, :2] = [[1, 2], [3, 4], [2**63 - 1, -5]]
    floats[0, :2] = [0.5, 1.25]
    inputs.send()
    assert inputs.ints[:, :2].tolist() == [[1, 2], [3, 4], [2**63 - 1, -5]] and inputs.floats[0, :2].tolist() == [0.5, 1.25]
    other, _ = inputs.fill()
    assert other is not ints and not other.any()  # the second buffer, never filled
    other[0, :] = 7
    inputs.send()
    assert inputs.ints[0].tolist() == [7] * 4 and inputs.ints[1, :2].tolist() == [0, 0]  # all of it sent, not only a row
    again, _ = inputs.fill()
    assert again is ints and again[2, 0] == 2**63 - 1  # back to the first: what it last sent is still there
    assert (inputs.ints.data_ptr(), inputs.floats.data_ptr()) == addresses
    assert inputs.ints.dtype == torch.int64 and inputs.floats.dtype == torch.float32


def test_step_inputs_carry_another_users_bytes_in_the_same_copy_sending_only_what_was_filled():
    """The extra bytes after the rows (a decode attention's slots and page table) start 8-aligned and go by the rows'
    copy; send(nbytes) stops there, leaving the device's bytes past it as they were (what flashinfer's own plan
    copied in)."""
    inputs = StepInputs(1, 1, 3, torch.device("cpu"), extra=32)  # 24 + 12 bytes of rows: the extra ones at 40
    assert inputs.extra_offset == 40 and len(inputs.staging.raw) == 72
    inputs.staging.raw[56:].fill_(9)  # written on the device by someone else
    ints, floats = inputs.fill()
    ints[0] = [1, 2, 3]
    floats[0] = [0.5, 0.25, 2.0]
    buf = inputs.staging.buffers[inputs.staging.turn]
    buf[40:56].view(np.int64)[:] = [11, 12]
    buf[56:] = 5
    inputs.send(56)
    assert inputs.ints.tolist() == [[1, 2, 3]] and inputs.floats.tolist() == [[0.5, 0.25, 2.0]]
    assert inputs.staging.raw[40:56].view(torch.int64).tolist() == [11, 12]
    assert inputs.staging.raw[56:].tolist() == [9] * 16


def test_step_inputs_a_graph_loads_come_from_the_staging_buffer_of_its_own_turn():
    """Loaded by the graph (Staging.loaded): send() queues nothing and flips the host's turn; the graph's load()
    takes the whole staging buffer of the device's turn (all of it: the byte count rounds up to whole words) and its
    turned() flips that, so replays in order read what was filled for each, while the host fills the other buffer;
    fence() hands fill() what to wait for (on the CPU, nothing: None)."""
    inputs = StepInputs(1, 1, 3, torch.device("cpu"), extra=3, loaded=True)  # 24 + 12 + 3 bytes: 48 loaded
    staging = inputs.staging
    assert len(staging.raw) == 48 and staging.turn == 0 and staging.turn_device.tolist() == [0]
    for value in (1, 2):  # two steps filled before the device loads either
        ints, floats = inputs.fill()
        ints[0], floats[0] = value, value / 4
        staging.buffers[staging.turn][40:43] = value + 10
        inputs.send()
        staging.fence(None)
    assert staging.turn == 0 and not inputs.ints.any()  # nothing copied by send()
    for value in (1, 2):  # the "graph" of each step in turn
        staging.load()
        assert inputs.ints.tolist() == [[value] * 3] and inputs.floats.tolist() == [[value / 4] * 3]
        assert staging.raw[40:43].tolist() == [value + 10] * 3
        staging.turned()
    assert staging.turn_device.tolist() == [0]


def test_a_fence_the_caller_has_waited_for_is_not_waited_for_again():
    """fill() synchronizes the event fence() gave the buffer it fills, unless the caller said the device passed it
    (reached(): the overlapped decode waited for that step's draws); an event fence() did not give changes nothing."""

    class Event:
        def __init__(self):
            self.synchronized = 0

        def synchronize(self) -> None:
            self.synchronized += 1

    staging = StepInputs(1, 1, 2, torch.device("cpu"), loaded=True).staging
    first, second, other = Event(), Event(), Event()
    staging.fill()
    staging.send()
    staging.fence(first)  # buffer 0's graph
    staging.fill()
    staging.send()
    staging.fence(second)  # buffer 1's
    staging.reached(first)
    staging.reached(other)
    staging.fill()  # buffer 0: its fence reached
    staging.send()
    staging.fence(None)
    staging.fill()  # buffer 1: waited for here
    assert (first.synchronized, second.synchronized, other.synchronized) == (0, 1, 0)
