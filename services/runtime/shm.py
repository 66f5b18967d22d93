"""Shared-memory tensor pools: a producer's slot table (and its host data) in a /dev/shm file, a first-fit allocator
over it, and a consumer's checked view of another process's pool. Consumers mark slots released; the producer frees
them and reclaims the rest after `reclaim_after_s`."""

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

from services.runtime import metrics
from services.runtime.errors import InvalidArgument

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_ALIGN = 64
MAX_SLOTS = 4096  # refs a pool has out at once
RECLAIM_AFTER_S = 30.0  # a crashed consumer's slots come back, long after any stream's slowest read
POOL_NAME = re.compile(r"omni-[A-Za-z0-9_-]+-[0-9]+")  # omni-{owner}-{pid}: what Transport.pool and CudaPool name
SWEEP_EVERY_S = 0.002  # a put frees released slots at most this often, and whenever it finds no room
_SLOT = np.dtype([("generation", "<u4"), ("released", "<u4"), ("offset", "<u8"), ("nbytes", "<u8"), ("t_alloc", "<f8")])


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
