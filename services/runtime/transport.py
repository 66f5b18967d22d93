"""Tensors between stages: by reference on one host (CUDA IPC for GPU tensors, shared memory otherwise), inline
bytes across hosts. A producer's pools each have a slot table in /dev/shm; the consumer copies a tensor out and
marks its slot released; the producer frees released slots and reclaims the rest after `reclaim_after_s`."""

import logging
import os
import threading

import numpy as np
import torch

from omni.stage.v1 import tensor_pb2
from services.runtime import metrics, shm
from services.runtime.config import TransportConfig
from services.runtime.shm import RECLAIM_AFTER_S, ShmPool, _PoolView, clean_stale_pools

log = logging.getLogger(__name__)

INLINE_BYTES = 16384  # host tensors this small go inside the message (a token's speech states)
SHM_DOMAIN = "local"  # one config's processes share /dev/shm (one host, one IPC namespace)

DTYPES = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32, torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16, torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32, torch.int16: tensor_pb2.DTYPE_INT16, torch.uint8: tensor_pb2.DTYPE_UINT8,
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


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
                self._pool = ShmPool(name, self.cfg.pool_bytes, shm.MAX_SLOTS, self.reclaim_after_s)
            return self._pool

    def cuda_pool(self, device: torch.device):
        """This process's pool on `device`, made on first use (stages warm it at start)."""
        from services.runtime.cuda_ipc import CudaPool

        with self._lock:
            if device not in self._cuda_pools:
                clean_stale_pools()
                self._cuda_pools[device] = CudaPool(self.owner, device, self.cfg.cuda_pool_bytes, shm.MAX_SLOTS,
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
