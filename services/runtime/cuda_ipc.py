"""GPU pools shared between processes of one host through CUDA IPC.

A producer allocates one buffer per GPU once and exports its IPC handle once; every ref carries that
handle, and a consumer maps each pool the first time it sees it and keeps the mapping. A consumer on
another GPU reads through peer access into its own memory. The slot table (release, reclaim) is a
ShmPool without host data. Exported memory must not come from expandable segments: PyTorch cannot
share those.

Copies in and out of a pool go through the copy engine (memcpy), or with `kernel` through a Triton kernel
of our own on the destination's GPU, which reads another GPU's pool through peer access (an SM-driven copy
can draw more of NVLink than the copy engine does).
"""

import contextlib
import os

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni.stage.v1 import tensor_pb2
from services.runtime.transport import ShmPool

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: copies by torch ops
    triton = None

COPY_BLOCK = 4096  # elements per program of the copy kernel

if triton is not None:
    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # PyTorch's own switch, read where it matters
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise RuntimeError("CUDA IPC pools need PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True")


class CudaPool:
    """A producer's buffer on one GPU, its exported handle, and its slot table."""

    def __init__(self, owner: str, device: torch.device, size: int, max_slots: int, reclaim_after_s: float,
                 kernel_copy: bool = False):
        _check_allocator()
        self.device, self.kernel_copy = device, kernel_copy
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.table = ShmPool(f"omni-{owner}-cuda{device.index}-{os.getpid()}", size, max_slots, reclaim_after_s, host_data=False)
        _, args = reduce_tensor(self.buffer)
        (_, _, _, _, _, _, dev, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
        self.handle = tensor_pb2.CudaPoolHandle(
            device=dev, handle=handle, storage_bytes=storage_bytes, storage_offset=storage_offset,
            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle or b"",
            event_sync_required=event_sync, pool_bytes=size,
        )

    def put(self, tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> tensor_pb2.CudaIpcSlot | None:
        """Copies `tensor` into a slot. The consumer reads from another process, so the bytes are there before
        this returns: with `ready` (recorded after the tensor's producer) the copy waits for that alone, on a
        stream of its own, not for work the stage queued since (its engine's next step)."""
        nbytes = tensor.numel() * tensor.element_size()
        got = self.table.alloc(nbytes)
        if got is None:
            return None
        slot, gen, offset = got
        dst = self.buffer[offset:offset + nbytes]
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if ready is None:
            copy_bytes(dst, src, self.kernel_copy)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            stream = _stream(self.device)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                copy_bytes(dst, src, self.kernel_copy)
            stream.synchronize()
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


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The transport's own stream on `device`: its copies wait for nothing the stage's engine queues."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, kernel: bool = False) -> None:
    """dst.copy_(src) for flat uint8 tensors of one size. With `kernel`, a kernel on the destination's device
    does it instead of the copy engine (Triton's where it is installed: also from another GPU's memory, through
    peer access; else an elementwise torch op, one device only), over the widest integers both addresses allow."""
    if not kernel:
        dst.copy_(src)
        return
    wide = next((w for w in (torch.int64, torch.int32, torch.int16)
                 if dst.numel() % w.itemsize == 0 and dst.data_ptr() % w.itemsize == 0 and src.data_ptr() % w.itemsize == 0),
                torch.uint8)
    d, s = dst.view(wide), src.view(wide)
    if triton is not None and (dst.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        if dst.device != src.device:
            _peer_access(dst.device, src.device)
        with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():  # launched where it writes
            _copy_kernel[(triton.cdiv(d.numel(), COPY_BLOCK),)](s, d, d.numel(), BLOCK=COPY_BLOCK)
    elif dst.device == src.device:
        torch.bitwise_or(s, 0, out=d)
    else:
        dst.copy_(src)


_PEERS: set[tuple[torch.device, torch.device]] = set()


def _peer_access(device: torch.device, peer: torch.device) -> None:
    """Lets kernels on `device` read `peer`'s memory: PyTorch enables peer access for a pair on the first copy
    between them, so one byte is copied once per pair."""
    if (device, peer) not in _PEERS:
        torch.empty(1, dtype=torch.uint8, device=device).copy_(torch.zeros(1, dtype=torch.uint8, device=peer))
        _PEERS.add((device, peer))


def read(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, device,
         kernel_copy: bool = False) -> torch.Tensor:
    """A copy, on `device`, of the tensor at `offset` of a mapped pool; complete when this returns.

    The copy runs on a stream of its own and only it is waited for: the producer finished writing before it
    sent the ref, so nothing queued in this process need come first, and a stage whose engine keeps the
    device busy (a talker step, a thinker step) does not hold up the thread that takes in its inputs."""
    target = torch.device(device)
    source = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
    stream = _stream(target if target.type == "cuda" else buffer.device)  # into host memory: on the pool's GPU
    with torch.cuda.stream(stream):
        if kernel_copy and target.type == "cuda" and (target == buffer.device or triton is not None):
            out = torch.empty(shape, dtype=dtype, device=target)
            copy_bytes(out.reshape(-1).view(torch.uint8), buffer[offset:offset + nbytes], kernel=True)
        else:
            out = source.to(target, copy=True)
    stream.synchronize()
    if target.type == "cuda":
        # Allocated on the read stream, used on the consumer's: its memory is not reused before that use is done.
        out.record_stream(torch.cuda.current_stream(target))
    return out
