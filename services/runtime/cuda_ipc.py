"""GPU pools shared between processes of one host through CUDA IPC.

A producer exports one buffer per GPU once; every ref carries its handle, and a consumer maps each pool once.
The slot table is a ShmPool without host data. Expandable segments cannot be shared, so they are refused."""

import contextlib
import os

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni.stage.v1 import tensor_pb2
from services.runtime.shm import ShmPool


def _check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # PyTorch's own variable
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise RuntimeError("CUDA IPC pools need PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True")


class CudaPool:
    """A producer's buffer on one GPU, its exported handle, and its slot table."""

    def __init__(self, owner: str, device: torch.device, size: int, max_slots: int, reclaim_after_s: float):
        _check_allocator()
        self.device = device
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.stream = _stream(device)  # made before any put, not while the stage's stream is busy
        self.table = ShmPool(f"omni-{owner}-cuda{device.index}-{os.getpid()}", size, max_slots, reclaim_after_s, host_data=False)
        _, args = reduce_tensor(self.buffer)
        (_, _, _, _, _, _, dev, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
        self.handle = tensor_pb2.CudaPoolHandle(
            device=dev, handle=handle, storage_bytes=storage_bytes, storage_offset=storage_offset,
            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle or b"",
            event_sync_required=event_sync, pool_bytes=size,
        )

    def put(self, parts: list[torch.Tensor], ready: torch.cuda.Event | None = None) -> tensor_pb2.CudaIpcSlot | None:
        """Copies `parts` end to end into a slot, done on return; with `ready`, on a side stream waiting only for it."""
        sizes = [t.numel() * t.element_size() for t in parts]
        got = self.table.alloc(sum(sizes))
        if got is None:
            return None
        slot, gen, offset = got
        stream = torch.cuda.current_stream(self.device) if ready is None else self.stream
        if ready is not None:
            stream.wait_event(ready)
        at = offset
        with torch.cuda.stream(stream):
            for t, n in zip(parts, sizes):
                self.buffer[at:at + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                at += n
        stream.synchronize()
        return tensor_pb2.CudaIpcSlot(pool=self.table.name, slot=slot, generation=gen, offset=offset, nbytes=sum(sizes),
                                      handle=self.handle)

    def close(self) -> None:
        self.table.close()


def open_pool(handle: tensor_pb2.CudaPoolHandle) -> torch.Tensor:
    """The producer's whole buffer, mapped into this process."""
    torch.cuda.init()
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.pool_bytes,), (1,), 0, torch.UntypedStorage, torch.uint8, handle.device, handle.handle,
        handle.storage_bytes, handle.storage_offset, False, handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle or None, handle.event_sync_required,
    )


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The transport's own stream on `device`: its copies wait for nothing the stage's engine queues."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def read(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, device) -> torch.Tensor:
    """A copy on `device` of the tensor at `offset`, on the transport's streams: nothing queued here need come first."""
    target = torch.device(device)
    source = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
    # Across GPUs torch copies on both devices' current streams: both the transport's here
    streams = [_stream(buffer.device)] + ([_stream(target)] if target.type == "cuda" and target != buffer.device else [])
    with contextlib.ExitStack() as on:
        for stream in streams:
            on.enter_context(torch.cuda.stream(stream))
        out = source.to(target, copy=True)
    streams[-1].synchronize()
    if target.type == "cuda":
        out.record_stream(torch.cuda.current_stream(target))  # made on the read stream, used on the consumer's
    return out
