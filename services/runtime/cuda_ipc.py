"""GPU pools shared between processes of one host through CUDA IPC.

A producer allocates one buffer per GPU once and exports its IPC handle once; every ref carries that
handle, and a consumer maps each pool the first time it sees it and keeps the mapping. A consumer on
another GPU reads through peer access into its own memory. The slot table (release, reclaim) is a
ShmPool without host data. Exported memory must not come from expandable segments: PyTorch cannot
share those.
"""

import os

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni.stage.v1 import tensor_pb2
from services.runtime.transport import ShmPool


def _check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # PyTorch's own switch, read where it matters
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise RuntimeError("CUDA IPC pools need PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True")


class CudaPool:
    """A producer's buffer on one GPU, its exported handle, and its slot table."""

    def __init__(self, owner: str, device: torch.device, size: int, max_slots: int, reclaim_after_s: float):
        _check_allocator()
        self.device = device
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.table = ShmPool(f"omni-{owner}-cuda{device.index}-{os.getpid()}", size, max_slots, reclaim_after_s, host_data=False)
        _, args = reduce_tensor(self.buffer)
        (_, _, _, _, _, _, dev, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
        self.handle = tensor_pb2.CudaPoolHandle(
            device=dev, handle=handle, storage_bytes=storage_bytes, storage_offset=storage_offset,
            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle or b"",
            event_sync_required=event_sync, pool_bytes=size,
        )

    def put(self, tensor: torch.Tensor) -> tensor_pb2.CudaIpcSlot | None:
        nbytes = tensor.numel() * tensor.element_size()
        got = self.table.alloc(nbytes)
        if got is None:
            return None
        slot, gen, offset = got
        self.buffer[offset:offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        # The consumer reads from another process: the bytes must be there before the ref leaves.
        torch.cuda.current_stream(self.device).synchronize()
        return tensor_pb2.CudaIpcSlot(pool=self.table.name, slot=slot, generation=gen, offset=offset, nbytes=nbytes, handle=self.handle)

    def close(self) -> None:
        self.table.close()


def open_pool(handle: tensor_pb2.CudaPoolHandle) -> torch.Tensor:
    """The producer's whole buffer, mapped into this process (done once per pool)."""
    torch.cuda.init()
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.pool_bytes,), (1,), 0, torch.UntypedStorage, torch.uint8, handle.device, handle.handle,
        handle.storage_bytes, handle.storage_offset, False, handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle or None, handle.event_sync_required,
    )


def read(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, device) -> torch.Tensor:
    """A copy, on `device`, of the tensor at `offset` of a mapped pool; complete when this returns."""
    target = torch.device(device)
    out = buffer[offset:offset + nbytes].view(dtype).reshape(shape).to(target, copy=True)
    if target.type == "cuda":  # the copy runs on the target's stream, after the source's: its end is the read's end
        torch.cuda.current_stream(target).synchronize()
    return out
