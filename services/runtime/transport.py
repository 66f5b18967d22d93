"""Tensors between stages: by reference on one host (CUDA IPC for GPU tensors, shared memory otherwise), inline
bytes across hosts. A producer's pools each have a slot table in /dev/shm; the consumer copies a tensor out and
marks its slot released; the producer frees released slots and reclaims the rest after `reclaim_after_s`."""

import atexit
import logging
import mmap
import os
import re
import stat
import threading
import time
from pathlib import Path

import numpy as np
import torch

from omni.stage.v1 import tensor_pb2
from services.runtime import metrics
from services.runtime.config import TransportConfig
from services.runtime.errors import InvalidArgument

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_ALIGN = 64
MAX_SLOTS = 4096  # refs a pool has out at once
RECLAIM_AFTER_S = 30.0  # a crashed consumer's slots come back, long after any stream's slowest read
INLINE_BYTES = 16384  # host tensors this small go inside the message (a token's speech states)
POOL_NAME = re.compile(r"omni-[A-Za-z0-9_-]+-[0-9]+")  # omni-{owner}-{pid}: what Transport.pool and CudaPool name
SHM_DOMAIN = "local"  # one config's processes share /dev/shm (one host, one IPC namespace)
SWEEP_EVERY_S = 0.002  # a put frees released slots at most this often, and whenever it finds no room
_SLOT = np.dtype([("generation", "<u4"), ("released", "<u4"), ("offset", "<u8"), ("nbytes", "<u8"), ("t_alloc", "<f8")])

DTYPES = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32, torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16, torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32, torch.int16: tensor_pb2.DTYPE_INT16, torch.uint8: tensor_pb2.DTYPE_UINT8,
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def clean_stale_pools() -> None:
    """Removes pools left in /dev/shm by processes that no longer exist (a stage that crashed)."""
    for path in SHM_DIR.glob("omni-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


class ShmPool:
    """A slot table and first-fit allocator in a /dev/shm file; the data after the table, or in a GPU buffer."""

    def __init__(self, name: str, size: int, max_slots: int, reclaim_after_s: float, host_data: bool = True):
        self.name, self.reclaim_after_s = name, reclaim_after_s
        self.kind = "shm" if host_data else name.rsplit("-", 2)[-2]
        self.path = SHM_DIR / name
        header = -(-max_slots * _SLOT.itemsize // _ALIGN) * _ALIGN
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, header + (size if host_data else 0))
            self._mm = mmap.mmap(fd, header + (size if host_data else 0))
        finally:
            os.close(fd)
        self.table = np.ndarray((max_slots,), dtype=_SLOT, buffer=self._mm)
        self.table[:] = 0
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._live = np.zeros(max_slots, dtype=bool)  # a mask, so a sweep reads the live rows at once
        self._live_count = self._live_bytes = 0
        self._swept = 0.0
        self._gauges = metrics.SHM_SLOTS.labels(self.kind), metrics.SHM_BYTES.labels(self.kind)
        start = header if host_data else 0
        self._free = [(start, size)]  # (offset, nbytes), sorted, coalesced
        self._lock = threading.Lock()
        self._closed = False
        self._sweeper = threading.Thread(target=self._sweep_forever, name=f"{name}-sweep", daemon=True)
        self._sweeper.start()
        atexit.register(self.close)

    def alloc(self, nbytes: int) -> tuple[int, int, int] | None:
        """(slot, generation, offset) for `nbytes`, or None when the pool is full."""
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            now = time.monotonic()
            if now - self._swept >= SWEEP_EVERY_S:
                self._sweep_locked()
            got = self._take_locked(need, now)
            if got is None and now - self._swept > 0:  # released slots may be waiting: look once more
                self._sweep_locked()
                got = self._take_locked(need, now)
            self._update_gauges()
            return got

    def _take_locked(self, need: int, now: float) -> tuple[int, int, int] | None:
        if not self._free_slots:
            return None
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                self._free[i:i + 1] = [(off + need, size - need)] if size > need else []
                slot = self._free_slots.pop()
                entry = self.table[slot]
                gen = (int(entry["generation"]) + 1) & 0xFFFFFFFF or 1
                entry["offset"], entry["nbytes"], entry["t_alloc"] = off, need, now
                entry["generation"] = gen
                self._live[slot] = True
                self._live_count += 1
                self._live_bytes += need
                return slot, gen, off
        return None

    def write(self, offset: int, data: torch.Tensor) -> None:
        flat = data.contiguous().reshape(-1).view(torch.uint8)
        torch.frombuffer(self._mm, dtype=torch.uint8, count=flat.numel(), offset=offset).copy_(flat)

    def sweep(self) -> None:
        with self._lock:
            self._sweep_locked()
            self._update_gauges()

    def _sweep_locked(self) -> None:
        """Frees every live slot its consumer released, and reclaims those held past `reclaim_after_s`."""
        self._swept = time.monotonic()
        live = np.flatnonzero(self._live)
        if len(live):
            rows = self.table[live]  # one copy of the live rows: consumers may be releasing meanwhile
            released = rows["released"] == rows["generation"]
            expired = ~released & (time.monotonic() - rows["t_alloc"] > self.reclaim_after_s)
            for slot in live[expired]:
                metrics.SHM_RECLAIMED.labels(self.kind).inc()
                log.warning("reclaimed shm slot %d of %s: never released", slot, self.name)
            done = released | expired
            if done.any():
                self._release_locked(live[done], rows["offset"][done], rows["nbytes"][done])

    def _release_locked(self, slots: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.table["released"][slots] = self.table["generation"][slots]  # a reclaimed slot reads as released
        self._live[slots] = False
        self._live_count -= len(slots)
        self._live_bytes -= int(sizes.sum())
        self._free_slots.extend(slots.tolist())
        free = sorted(self._free + list(zip(offsets.tolist(), sizes.tolist())))
        merged = [free[0]]
        for o, s in free[1:]:
            lo, ls = merged[-1]
            if lo + ls == o:
                merged[-1] = (lo, ls + s)
            else:
                merged.append((o, s))
        self._free = merged

    def _update_gauges(self) -> None:
        self._gauges[0].set(self._live_count)
        self._gauges[1].set(self._live_bytes)

    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return self._live_count

    def _sweep_forever(self) -> None:
        period = max(0.05, min(1.0, self.reclaim_after_s / 4))
        while not self._closed:
            time.sleep(period)
            if not self._closed:
                self.sweep()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class _PoolView:
    """A consumer's mapping of another process's pool, opened once."""

    def __init__(self, name: str):
        if not POOL_NAME.fullmatch(name):
            raise InvalidArgument(f"TensorRef names {name}, which is not a tensor pool of this mesh")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            raise InvalidArgument(f"TensorRef names the tensor pool {name}, which does not exist") from None
        try:
            st = os.fstat(fd)
            # Only pools this user's producers made: a file of another owner, or too small for a slot table, is not one
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or st.st_size < MAX_SLOTS * _SLOT.itemsize:
                raise InvalidArgument(f"TensorRef names {name}, which is not a tensor pool of this mesh")
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)

    def entry(self, slot: int):
        if not 0 <= slot < MAX_SLOTS:
            raise InvalidArgument(f"TensorRef names slot {slot}, past the pool's {MAX_SLOTS}")
        return np.ndarray((), dtype=_SLOT, buffer=self.mm, offset=slot * _SLOT.itemsize)

    def check_span(self, offset: int, nbytes: int) -> None:
        if not MAX_SLOTS * _SLOT.itemsize <= offset <= offset + nbytes <= len(self.mm):
            raise InvalidArgument(f"TensorRef's {nbytes} bytes at offset {offset} lie outside its pool")


class Transport:
    def __init__(self, cfg: TransportConfig, owner: str, reclaim_after_s: float = RECLAIM_AFTER_S):
        self.cfg, self.owner, self.reclaim_after_s = cfg, owner, reclaim_after_s
        self.shm_domain = SHM_DOMAIN if cfg.shm else ""
        self._pool: ShmPool | None = None
        self._cuda_pools: dict = {}  # device -> CudaPool
        self._views: dict[str, _PoolView] = {}
        self._mapped: dict[str, torch.Tensor] = {}  # other processes' GPU pools
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], tuple] = {}  # looked up once: a labels() call is slow

    @property
    def pool(self) -> ShmPool:
        with self._lock:
            if self._pool is None:
                clean_stale_pools()
                name = f"omni-{self.owner}-{os.getpid()}"
                self._pool = ShmPool(name, self.cfg.pool_bytes, MAX_SLOTS, self.reclaim_after_s)
            return self._pool

    def cuda_pool(self, device: torch.device):
        """This process's pool on `device`, made on first use (stages warm it at start)."""
        from services.runtime.cuda_ipc import CudaPool

        with self._lock:
            if device not in self._cuda_pools:
                clean_stale_pools()
                self._cuda_pools[device] = CudaPool(self.owner, device, self.cfg.cuda_pool_bytes, MAX_SLOTS,
                                                    self.reclaim_after_s)
            return self._cuda_pools[device]

    def _count(self, transport: str, direction: str, nbytes: int) -> None:
        counters = self._counters.get((transport, direction))
        if counters is None:
            counters = self._counters[transport, direction] = (metrics.TRANSPORT_BYTES.labels(transport, direction),
                                                                metrics.TRANSPORT_TRANSFERS.labels(transport, direction))
        counters[0].inc(nbytes)
        counters[1].inc()

    def put(self, tensor: torch.Tensor | list[torch.Tensor], placement: tensor_pb2.Placement | None,
            ready=None) -> tensor_pb2.TensorRef:
        """A ref to `tensor` (a list: as its stack) for `placement`; a CUDA tensor is read after `ready` if given."""
        stacked = isinstance(tensor, (list, tuple))
        parts = [t.detach() for t in tensor] if stacked else [tensor.detach()]
        first = parts[0] if parts else None
        if first is None or any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in parts):
            raise ValueError("tensors put together must be one or more of the same shape, dtype and device")
        if first.dtype not in DTYPES:
            raise TypeError(f"unsupported dtype {first.dtype}")
        ref = tensor_pb2.TensorRef(dtype=DTYPES[first.dtype], shape=[len(parts), *first.shape] if stacked else list(first.shape))
        nbytes = len(parts) * first.numel() * first.element_size()
        same_host = bool(nbytes > (0 if first.is_cuda else INLINE_BYTES) and self.shm_domain
                         and placement is not None and placement.shm_domain == self.shm_domain)
        if same_host and first.is_cuda and placement.cuda:
            pool = self.cuda_pool(first.device)
            slot = pool.put(parts, ready)
            if slot is not None:
                ref.cuda.CopyFrom(slot)
                self._count("cuda_ipc", "out", nbytes)
                return ref
            metrics.SHM_FALLBACKS.labels(pool.table.kind).inc()
        tensor = torch.stack(parts) if stacked else first
        if same_host:
            got = self.pool.alloc(nbytes)
            if got is not None:
                slot, gen, offset = got
                self.pool.write(offset, tensor.cpu())
                ref.shm.CopyFrom(tensor_pb2.ShmSlot(pool=self.pool.name, slot=slot, generation=gen, offset=offset, nbytes=nbytes))
                self._count("shm", "out", nbytes)
                return ref
            metrics.SHM_FALLBACKS.labels("shm").inc()
        ref.inline_data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        self._count("inline", "out", nbytes)
        return ref

    def get(self, ref: tensor_pb2.TensorRef, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor a ref names, on `device`; its slot is released once read."""
        dtype = TORCH_DTYPES.get(ref.dtype)
        if dtype is None:
            raise ValueError(f"TensorRef has unknown dtype {ref.dtype}")
        shape = tuple(ref.shape)
        count = int(np.prod(shape)) if shape else 1
        where = ref.WhichOneof("location")
        if where == "inline_data":
            if len(ref.inline_data) != count * dtype.itemsize:
                raise ValueError(f"TensorRef inline data has {len(ref.inline_data)} bytes, shape {shape} needs {count * dtype.itemsize}")
            out = torch.frombuffer(bytearray(ref.inline_data), dtype=dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)
            self._count("inline", "in", len(ref.inline_data))
            return _from_host(out, device)
        if where not in ("shm", "cuda"):
            raise ValueError("TensorRef has no location")
        s = getattr(ref, where)
        if s.nbytes != count * dtype.itemsize:
            raise ValueError(f"TensorRef slot has {s.nbytes} bytes, shape {shape} needs {count * dtype.itemsize}")
        entry = self._view(s.pool).entry(s.slot)

        def live() -> bool:
            return int(entry["generation"]) == s.generation and int(entry["released"]) != s.generation

        if not live():
            raise ValueError(f"slot {s.pool}/{s.slot} was released or reclaimed before it was read")
        if where == "shm":
            self._view(s.pool).check_span(s.offset, s.nbytes)
            out = _from_host(torch.frombuffer(self._view(s.pool).mm, dtype=dtype, count=count, offset=s.offset).reshape(shape),
                             device, copy=True)
        else:
            from services.runtime.cuda_ipc import read

            out = read(self._mapped_pool(s), s.offset, s.nbytes, dtype, shape, device)
        if not live():  # reclaimed while we copied: we may have read another tensor
            raise ValueError(f"slot {s.pool}/{s.slot} was reclaimed while it was read")
        entry["released"] = s.generation
        self._count("cuda_ipc" if where == "cuda" else "shm", "in", s.nbytes)
        return out

    def release(self, ref: tensor_pb2.TensorRef) -> None:
        """Gives a ref's slot back unread."""
        where = ref.WhichOneof("location")
        if where not in ("shm", "cuda"):
            return
        s = getattr(ref, where)
        entry = self._view(s.pool).entry(s.slot)
        if int(entry["generation"]) == s.generation:
            entry["released"] = s.generation

    def _mapped_pool(self, s: tensor_pb2.CudaIpcSlot) -> torch.Tensor:
        from services.runtime.cuda_ipc import open_pool

        with self._lock:
            if s.pool not in self._mapped:
                self._mapped[s.pool] = open_pool(s.handle)
            return self._mapped[s.pool]

    def _view(self, pool: str) -> _PoolView:
        with self._lock:
            if pool not in self._views:
                self._views[pool] = _PoolView(pool)
            return self._views[pool]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        for pool in self._cuda_pools.values():
            pool.close()


def _from_host(src: torch.Tensor, device, copy: bool = False) -> torch.Tensor:
    """`src` on `device`; to a GPU by pinned memory on the transport's stream, not waiting on the engine's work."""
    target = torch.device(device)
    if target.type != "cuda":
        return src.to(target, copy=copy)
    from services.runtime.cuda_ipc import _stream

    stream = _stream(target)
    staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    # numpy's copy on this thread: torch's would wake a thread per core
    np.copyto(staged.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    with torch.cuda.stream(stream):
        out = staged.to(target, non_blocking=True)
    stream.synchronize()
    out.record_stream(torch.cuda.current_stream(target))  # made on the transport's stream, used on the caller's
    return out
