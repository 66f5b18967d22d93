"""Host values for the device, sent without waiting for it.

A copy from pageable host memory may wait for every kernel queued before it (the driver stages it through
pinned memory it may have to synchronise for), which after a graph replay means the whole step: the host
then spends the step blocked where it meant to queue work. From pinned memory the copy is queued behind
those kernels like one more of them. torch's pinned-memory cache keeps each buffer until its copy is done.
"""

import time

import numpy as np
import torch

# Host lists become tensors through numpy: torch.tensor() converts element by element, several times slower for a
# decode step's thousands of page ids.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.bool: np.bool_}


def _from_lists(values, dtype: torch.dtype | None, pin: bool) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, pin_memory=pin), the values converted by numpy."""
    if dtype is not None and dtype not in _NUMPY:  # a type numpy lacks (bfloat16): as torch makes it
        return torch.tensor(values, dtype=dtype, pin_memory=pin)
    array = np.asarray(values, dtype=None if dtype is None else _NUMPY[dtype])
    if dtype is None:  # torch.tensor's choice: Python floats become the default dtype, ints int64
        dtype = {"f": torch.get_default_dtype(), "i": torch.int64, "b": torch.bool}.get(array.dtype.kind)
        if dtype is None:  # ints past int64 (numpy made them uint64 or objects): torch.tensor says what is wrong
            return torch.tensor(values, pin_memory=pin)
        array = array.astype(_NUMPY[dtype], copy=False)
    if not pin:
        return torch.from_numpy(array)
    out = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    out.numpy()[...] = array  # numpy's copy: torch's would wake a thread per core for a large one
    return out


def _host(values, dtype: torch.dtype | None, pin: bool) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        host = values.to(dtype) if dtype is not None else values
        return host.pin_memory() if pin else host
    return _from_lists(values, dtype, pin)


def pinned(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` in pinned host memory, for a library that copies them to the device itself without blocking
    (flashinfer's plans): from pageable memory that copy would wait for the device first."""
    return _host(values, dtype, torch.cuda.is_available())


def upload(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (nested lists or a CPU tensor) on `device`, queued without waiting on it."""
    return _host(values, dtype, device.type == "cuda").to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values) -> None:
    """Copies `values` into the device tensor `dst` (same shape), queued without waiting on the device."""
    dst.copy_(_host(values, dst.dtype, dst.device.type == "cuda"), non_blocking=True)


def scalar(value, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-dim tensor of `like`'s dtype on its device, made there by a fill. Assigned through an index
    tensor (`x[rows, cols] = value`), a Python number is made in host memory and copied over first, a copy that
    waits for everything queued on the device (a slice assignment fills without one)."""
    return torch.full((), value, dtype=like.dtype, device=like.device)


def mark(device: torch.device):
    """A point on the device's timeline: a CUDA event recorded on `device`'s current stream on a GPU (named: a
    thread's current device may be another GPU), the host's clock elsewhere (where the work between two marks is
    done when the second is taken)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def reached(m) -> bool:
    return not hasattr(m, "query") or m.query()


def wait_for(m) -> None:
    """Until the device reaches the mark `m` (nothing to wait for off a GPU)."""
    if hasattr(m, "synchronize"):
        m.synchronize()


def seconds_between(a, b) -> float:
    return a.elapsed_time(b) / 1000 if hasattr(a, "elapsed_time") else b - a

class Laps:
    """The host's seconds in each phase of its steps, summed over them: `start()` at a step's beginning, then
    `lap(name)` charges the time since the last mark to `name`, less what `waited()` reported inside it (charged
    to "wait" instead). Two clock reads a phase; benches read `seconds` before and after a run and divide the
    difference by its steps. `cpu_waited`: the thread's CPU seconds inside those waits (CUDA may spin in them), so
    a bench can tell the host's CPU time a step from its wall time (they differ where the machine takes the CPU
    away: another thread, another process, a hypervisor's steal)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._t, self._waited = time.perf_counter(), 0.0
        self.cpu_waited = 0.0

    def start(self) -> None:
        self._t, self._waited = time.perf_counter(), 0.0

    def lap(self, name: str) -> None:
        t = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + t - self._t - self._waited
        self._t, self._waited = t, 0.0

    def waited(self, seconds: float, cpu: float = 0.0) -> None:
        """The host was blocked on the device this long since the last mark, `cpu` of it on the CPU (thread time)."""
        self._waited += seconds
        self.cpu_waited += cpu
        self.seconds["wait"] = self.seconds.get("wait", 0.0) + seconds


def laps_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds a step in each phase between two reads of Laps.seconds."""
    return {k: round(1000 * (v - before.get(k, 0.0)) / max(steps, 1), 4) for k, v in after.items()}


_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.uint8: "|u1", torch.float32: "<f4"}


class _CudaArray:
    """Pinned host memory described by the CUDA array interface (torch.as_tensor then makes a CUDA tensor over it)."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # kept alive as long as the device's view of it
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
                                         "strides": tuple(host.element_size() * s for s in host.stride()),
                                         "data": (host.data_ptr(), False), "version": 3}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned host memory `host` as a tensor on `device` that kernels (a graph's too) read and write across the bus:
    under CUDA's unified addressing a pinned buffer's host address is its device address. On the CPU, `host`."""
    if torch.device(device).type != "cuda":
        return host
    view = torch.as_tensor(_CudaArray(host), device=device)
    assert view.data_ptr() == host.data_ptr()
    return view


class Staging:
    """A device buffer the host fills each step (`nbytes` bytes, its address fixed: graphs read it), through pinned
    staging buffers, two of them in turn: one is filled while the other's may still be read for the step the device
    is running, and each is waited for before it is filled again.

    Sent by the host (the default), each step's buffer goes by one copy, whose event is that wait. `loaded`: the
    graph that reads the buffer loads it itself (`load()` first in its body, `turned()` last) from the staging
    buffer of its turn, read across the bus; send() then queues nothing, and the caller hands over an event that
    follows the graph (`fence()`) for the wait: two calls to the driver a step fewer, each 5-10 us in a tight loop
    on the lent H200s and several times that beside a running step (bench/results/callcost-1xh200-*.json)."""

    def __init__(self, nbytes: int, device: torch.device, loaded: bool = False):
        cuda = torch.device(device).type == "cuda"
        self.loaded = loaded
        if loaded:  # whole 8-byte words: the graph loads them as int64
            nbytes = -(-nbytes // 8) * 8
        self.raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host = torch.zeros(2, -(-nbytes // 8) * 8, dtype=torch.uint8, pin_memory=cuda)  # each buffer 8-aligned
        self._staging = [host[0, :nbytes], host[1, :nbytes]]
        self.buffers = [s.numpy() for s in self._staging]  # their bytes, for views of a caller's own over them
        self._copied = [torch.cuda.Event() if cuda and not loaded else None for _ in range(2)]
        self._pending = [False, False]  # a copy from (a load of) this staging buffer was queued and not yet seen done
        self.turn = 0  # which staging buffer fill() and send() take next
        if loaded:
            # The graph's own `turn`, flipped by each of its replays as send() flips the host's
            self.turn_device = torch.zeros(1, dtype=torch.long, device=device)
            self._words = device_view(host.view(torch.int64), self.raw.device)  # [2, nbytes / 8]
            self._raw_words = self.raw.view(torch.int64).view(1, -1)

    def fill(self) -> np.ndarray:
        """The bytes `send()` copies next (a numpy view of the pinned buffer, holding what it last sent), its
        last copy (load) waited for: done long ago in a decode loop, where the step after it was read."""
        if self._pending[self.turn]:
            if self._copied[self.turn] is not None:
                self._copied[self.turn].synchronize()
            self._pending[self.turn] = False
        return self.buffers[self.turn]

    def send(self, nbytes: int | None = None) -> None:
        """Queues the copy of the first `nbytes` (all) of the buffer last filled, without waiting. Loaded by the
        graph: nothing is queued (the graph loads the whole buffer), and fence() is to follow."""
        if self.loaded:
            self.turn ^= 1
            return
        n = len(self.raw) if nbytes is None else nbytes
        self.raw[:n].copy_(self._staging[self.turn][:n], non_blocking=True)
        if self.raw.is_cuda:
            self._copied[self.turn].record(torch.cuda.current_stream(self.raw.device))
            self._pending[self.turn] = True
        self.turn ^= 1

    def fence(self, event) -> None:
        """Loaded by the graph: `event` (a CUDA event; None on the CPU, where the graph has run) follows the graph
        that loads the buffer last sent. fill() waits for it before that buffer is filled again."""
        self._copied[self.turn ^ 1] = event
        self._pending[self.turn ^ 1] = event is not None

    def reached(self, event) -> None:
        """The device has passed `event`, one that fence() took (the caller waited for it, or for a later one on the
        same stream): fill() need not ask the driver again before filling that buffer."""
        for i in (0, 1):
            if self._copied[i] is event:
                self._pending[i] = False

    def load(self) -> None:
        """In the graph, first (loaded): the device buffer from the staging buffer of the graph's turn."""
        torch.index_select(self._words, 0, self.turn_device, out=self._raw_words)

    def turned(self) -> None:
        """In the graph, last (loaded): its next replay loads the other staging buffer."""
        self.turn_device.bitwise_xor_(1)


class StepInputs:
    """A captured step's values from the host in one device buffer, sent by one copy a step or loaded by the graph
    itself (Staging, `loaded`): `ints` [I, width] int64 and `floats` [F, width] float32, views whose addresses never
    change, then `extra` bytes from `extra_offset` for another user of the same copy (the step's decode attention:
    its slots and page table). Sent row by row, a step's five to seven kinds of values took as many copies, each
    through a pinned buffer of its own and, into a view narrower than its rows, a device kernel too. `fill()` hands
    out numpy views of the staging buffer to send next, still holding what was last sent from it."""

    def __init__(self, ints: int, floats: int, width: int, device: torch.device, extra: int = 0, loaded: bool = False):
        self._split = 8 * ints * width
        self.extra_offset = -(-(self._split + 4 * floats * width) // 8) * 8  # 8-aligned, for int64 views
        self.staging = Staging(self.extra_offset + extra, device, loaded)
        raw = self.staging.raw
        self.ints = raw[:self._split].view(torch.int64).view(ints, width)
        self.floats = raw[self._split:self._split + 4 * floats * width].view(torch.float32).view(floats, width)
        self._views = [(b[:self._split].view(np.int64).reshape(ints, width),
                        b[self._split:self._split + 4 * floats * width].view(np.float32).reshape(floats, width))
                       for b in self.staging.buffers]

    def fill(self) -> tuple[np.ndarray, np.ndarray]:
        self.staging.fill()
        return self._views[self.staging.turn]

    def send(self, nbytes: int | None = None) -> None:
        """Sends the rows filled (and the extra bytes' first `nbytes - extra_offset`: `nbytes` counts from the
        start; all of them by default)."""
        self.staging.send(nbytes)
