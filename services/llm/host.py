"""Host values for the device, sent without waiting for it.

A copy from pageable memory may wait for every kernel queued before it (the driver stages it through pinned
memory), which after a graph replay is the whole step; from pinned memory it is queued like one more kernel."""

import time

import numpy as np
import torch

# Through numpy: torch.tensor() converts element by element, several times slower for a step's page ids.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.bool: np.bool_}


def _from_lists(values, dtype: torch.dtype | None, pin: bool) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, pin_memory=pin), the values converted by numpy."""
    if dtype is not None and dtype not in _NUMPY:  # a type numpy lacks (bfloat16): as torch makes it
        return torch.tensor(values, dtype=dtype, pin_memory=pin)
    array = np.asarray(values, dtype=None if dtype is None else _NUMPY[dtype])
    if dtype is None:  # torch.tensor's choice: Python floats become the default dtype, ints int64
        dtype = {"f": torch.get_default_dtype(), "i": torch.int64, "b": torch.bool}.get(array.dtype.kind)
        if dtype is None:  # ints past int64: torch.tensor raises its own error
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
    """`values` in pinned memory, for a library's own copy to the device (flashinfer's plans) not to block."""
    return _host(values, dtype, torch.cuda.is_available())


def upload(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (nested lists or a CPU tensor) on `device`, queued without waiting on it."""
    return _host(values, dtype, device.type == "cuda").to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values) -> None:
    """Copies `values` into the device tensor `dst` (same shape), queued without waiting on the device."""
    dst.copy_(_host(values, dst.dtype, dst.device.type == "cuda"), non_blocking=True)


def scalar(value, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-d tensor on `like`'s device: a Python number assigned by index is a blocking copy."""
    return torch.full((), value, dtype=like.dtype, device=like.device)


def mark(device: torch.device):
    """A CUDA event on `device`'s current stream (a thread's current GPU may be another); off a GPU, the host clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def reached(m) -> bool:
    return not hasattr(m, "query") or m.query()


def wait_for(m) -> None:
    if hasattr(m, "synchronize"):
        m.synchronize()


def seconds_between(a, b) -> float:
    return a.elapsed_time(b) / 1000 if hasattr(a, "elapsed_time") else b - a

class Laps:
    """Host seconds per phase, summed over steps: `lap(name)` charges the time since the last mark, less `waited()`
    (charged to "wait"); `cpu_waited` is the CPU time inside waits, which CUDA may spend spinning."""

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
        """The host was blocked this long since the last mark, `cpu` of it on the CPU."""
        self._waited += seconds
        self.cpu_waited += cpu
        self.seconds["wait"] = self.seconds.get("wait", 0.0) + seconds


def laps_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds a step in each phase between two reads of Laps.seconds."""
    return {k: round(1000 * (v - before.get(k, 0.0)) / max(steps, 1), 4) for k, v in after.items()}


_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.uint8: "|u1", torch.float32: "<f4"}


class _CudaArray:
    """Pinned host memory through the CUDA array interface, for torch.as_tensor to view on the device."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # alive as long as the device's view
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
                                         "strides": tuple(host.element_size() * s for s in host.stride()),
                                         "data": (host.data_ptr(), False), "version": 3}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (pinned) as a `device` tensor kernels read across the bus: unified addressing, same address."""
    if torch.device(device).type != "cuda":
        return host
    view = torch.as_tensor(_CudaArray(host), device=device)
    assert view.data_ptr() == host.data_ptr()
    return view


class Staging:
    """A device buffer at a fixed address (graphs read it) the host fills each step through two pinned buffers in
    turn: one is filled while the device may still read the other, and each is waited for before it is refilled.

    By default a step's buffer goes by one copy, whose event is that wait. `loaded`: the graph loads it itself
    across the bus (`load()` first, `turned()` last) and the caller hands over an event after the graph (`fence()`):
    two driver calls a step fewer, and those are slow beside a running step."""

    def __init__(self, nbytes: int, device: torch.device, loaded: bool = False):
        cuda = torch.device(device).type == "cuda"
        self.loaded = loaded
        if loaded:  # whole words: the graph loads int64s
            nbytes = -(-nbytes // 8) * 8
        self.raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host = torch.zeros(2, -(-nbytes // 8) * 8, dtype=torch.uint8, pin_memory=cuda)  # each buffer 8-aligned
        self._staging = [host[0, :nbytes], host[1, :nbytes]]
        self.buffers = [s.numpy() for s in self._staging]  # for a caller's own views
        self._copied = [torch.cuda.Event() if cuda and not loaded else None for _ in range(2)]
        self._pending = [False, False]  # a copy (load) queued and not yet seen done
        self.turn = 0
        if loaded:
            self.turn_device = torch.zeros(1, dtype=torch.long, device=device)  # the graph's own `turn`
            self._words = device_view(host.view(torch.int64), self.raw.device)  # [2, nbytes / 8]
            self._raw_words = self.raw.view(torch.int64).view(1, -1)

    def fill(self) -> np.ndarray:
        """The numpy bytes `send()` copies next (still holding what they last sent), once their last copy is done."""
        if self._pending[self.turn]:
            if self._copied[self.turn] is not None:
                self._copied[self.turn].synchronize()
            self._pending[self.turn] = False
        return self.buffers[self.turn]

    def send(self, nbytes: int | None = None) -> None:
        """Queues the copy of the first `nbytes` (all) of the buffer filled; loaded, nothing (fence() follows)."""
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
        """Loaded: `event` follows the graph that reads the buffer last sent (None on the CPU); fill() waits for it."""
        self._copied[self.turn ^ 1] = event
        self._pending[self.turn ^ 1] = event is not None

    def reached(self, event) -> None:
        """The device has passed `event` (one fence() took), so fill() need not ask the driver."""
        for i in (0, 1):
            if self._copied[i] is event:
                self._pending[i] = False

    def load(self) -> None:
        """First in the graph: the device buffer from the staging buffer of the graph's turn."""
        torch.index_select(self._words, 0, self.turn_device, out=self._raw_words)

    def turned(self) -> None:
        """Last in the graph: its next replay loads the other staging buffer."""
        self.turn_device.bitwise_xor_(1)


class StepInputs:
    """A step's host values in one buffer, one copy for all: `ints` [I, width], `floats` [F, width], `extra` bytes."""

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
        """Sends the first `nbytes` (from the start, extra bytes included; all by default)."""
        self.staging.send(nbytes)
