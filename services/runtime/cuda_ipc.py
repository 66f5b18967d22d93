"""GPU pools shared between processes of one host through CUDA IPC.

A producer allocates one buffer per GPU once and exports its IPC handle once; every ref carries that
handle, and a consumer maps each pool the first time it sees it and keeps the mapping. A consumer on
another GPU reads through peer access into its own memory: either as PyTorch copies between GPUs (the copy
launched on the source GPU, so the consumer keeps a context there beside the producer's), or pulled by its
own GPU (transport.cross_gpu_read: pull), the pool mapped into that GPU's context through the CUDA runtime.
The slot table (release, reclaim) is a ShmPool without host data. Exported memory must not come from
expandable segments: PyTorch cannot share those.
"""

import contextlib
import ctypes
import os

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni.stage.v1 import tensor_pb2
from services.runtime.transport import ShmPool


_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: directions from the (unified) addresses
_CUDART = None


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # cudaIpcMemHandle_t, passed by value


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime PyTorch loaded (found in this process's mappings), for the two calls PyTorch does not
    expose: mapping an IPC handle into a chosen GPU's context, and a copy on a chosen stream between raw
    addresses."""
    global _CUDART
    if _CUDART is None:
        torch.cuda.init()
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
        lib = ctypes.CDLL(paths[0] if paths else "libcudart.so")
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        _CUDART = lib
    return _CUDART


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: {_cudart().cudaGetErrorString(status).decode()} (CUDA error {status})")


def ipc_handle_bytes(handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t inside PyTorch's shared-storage handle: a version byte, a kind byte ('c': from
    cudaMalloc; the other kind, expandable segments, is refused before export), then its 64 bytes (the layout
    of versions 2 and 3, PyTorch 2.11 to 2.13); a bare 64-byte handle is one already."""
    if len(handle) == 66 and handle[1] == ord("c"):
        return handle[2:]
    if len(handle) == 64:
        return handle
    raise ValueError(f"not a cudaMalloc IPC handle: {len(handle)} bytes, kind {handle[1:2]!r}")


class PeerPool:
    """A producer's pool mapped into the context of another GPU of this process (`device`), which reads it
    over the link with its own copy engines: this process opens no context on the producer's GPU for it, so
    the producer's GPU does not switch between the two processes' work to serve a read."""

    def __init__(self, handle: tensor_pb2.CudaPoolHandle, device: torch.device):
        self.device, self.source = device, torch.device("cuda", handle.device)
        ptr = ctypes.c_void_p()
        raw = _IpcMemHandle.from_buffer_copy(ipc_handle_bytes(handle.handle))
        with torch.cuda.device(device):
            _check(_cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _IPC_LAZY_ENABLE_PEER_ACCESS),
                   f"mapping a pool of GPU {handle.device} into GPU {device.index}")
        self.base = ptr.value + handle.storage_offset
        self.nbytes = handle.pool_bytes


def read_pulled(pool: PeerPool, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, lanes: int = 1,
                ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """A copy, on the pool's mapped GPU, of the tensor at `offset`: pulled by that GPU in `lanes` parts (each on
    its own stream) for a large one, after the producer's `ready` event where there is one; complete when this
    returns."""
    if offset < 0 or offset + nbytes > pool.nbytes:
        raise ValueError(f"bytes {offset}..{offset + nbytes} are outside the pool ({pool.nbytes} bytes)")
    target = pool.device
    with torch.cuda.stream(_stream(target)):
        out = torch.empty(nbytes, dtype=torch.uint8, device=target)
    parts = lane_bounds(nbytes, lanes)
    if ready is not None:
        # An interprocess event waited for by another GPU's stream crashes the driver (segfault on the H200s):
        # it is waited for on its own GPU's transport stream, and that stream's own event by this GPU's lanes.
        relay = torch.cuda.Event()
        source = _stream(pool.source)
        source.wait_event(ready)
        relay.record(source)
        for lane in range(len(parts)):
            _stream(target, lane).wait_event(relay)
    with torch.cuda.device(target):
        for lane, (a, b) in enumerate(parts):
            _check(_cudart().cudaMemcpyAsync(out.data_ptr() + a, pool.base + offset + a, b - a, _MEMCPY_DEFAULT,
                                             _stream(target, lane).cuda_stream), "pulling from another GPU")
    for lane in range(len(parts)):
        _stream(target, lane).synchronize()
    out.record_stream(torch.cuda.current_stream(target))  # made on the transport's stream, used on the consumer's
    return out.view(dtype).reshape(shape)


def _check_allocator() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # PyTorch's own switch, read where it matters
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise RuntimeError("CUDA IPC pools need PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True")


class CudaPool:
    """A producer's buffer on one GPU, its exported handle, and its slot table."""

    def __init__(self, owner: str, device: torch.device, size: int, max_slots: int, reclaim_after_s: float,
                 events: bool = False):
        _check_allocator()
        self.device = device
        self.events: dict[int, tuple[torch.cuda.Event, bytes]] | None = {} if events else None  # slot -> event, handle
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.stream = _stream(device)  # made here, before any put: not while the stage's stream is busy
        self.table = ShmPool(f"omni-{owner}-cuda{device.index}-{os.getpid()}", size, max_slots, reclaim_after_s, host_data=False)
        _, args = reduce_tensor(self.buffer)
        (_, _, _, _, _, _, dev, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
        self.handle = tensor_pb2.CudaPoolHandle(
            device=dev, handle=handle, storage_bytes=storage_bytes, storage_offset=storage_offset,
            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle or b"",
            event_sync_required=event_sync, pool_bytes=size,
        )

    def put(self, parts: list[torch.Tensor], ready: torch.cuda.Event | None = None) -> tensor_pb2.CudaIpcSlot | None:
        """Copies `parts` (one tensor, or several laid end to end: a stack without stacking them) into a slot.
        With `ready` (recorded after the tensors' producer) the copies wait for that alone, on a stream of their
        own, not for work the stage queued since (its engine's next step). The consumer reads from another
        process: the bytes are there before this returns, or, with events, the slot's interprocess event is
        recorded after the copies and sent for the consumer's copy to wait on (the parts' memory is kept from
        reuse until the copies ran; their contents must not change before)."""
        sizes = [t.numel() * t.element_size() for t in parts]
        nbytes = sum(sizes)
        got = self.table.alloc(nbytes)
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
        event = b""
        if self.events is None:
            stream.synchronize()
        else:
            if slot not in self.events:  # one per slot: a consumer waits on it before the slot can be reused
                self.events[slot] = torch.cuda.Event(interprocess=True), b""
            made, event = self.events[slot]
            made.record(stream)
            if not event:  # its handle exists once the event does (at its first record, on the pool's GPU)
                event = made.ipc_handle()
                self.events[slot] = made, event
            for t in parts:
                if t.device == self.device:
                    t.record_stream(stream)
        return tensor_pb2.CudaIpcSlot(pool=self.table.name, slot=slot, generation=gen, offset=offset, nbytes=nbytes,
                                      handle=self.handle, ready_event=event)

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


_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
LANE_MIN_BYTES = 8 << 20  # a read from another GPU smaller than this is one copy: more would only add launches
LANE_ALIGN = 1 << 16


def _stream(device: torch.device, lane: int = 0) -> torch.cuda.Stream:
    """The transport's own stream on `device` (one per lane): its copies wait for nothing the stage's engine queues."""
    if (device, lane) not in _STREAMS:
        _STREAMS[device, lane] = torch.cuda.Stream(device)
    return _STREAMS[device, lane]


def lane_bounds(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges splitting `nbytes` into at most `lanes` contiguous parts, inner bounds on
    LANE_ALIGN: one part below LANE_MIN_BYTES."""
    if lanes <= 1 or nbytes < LANE_MIN_BYTES:
        return [(0, nbytes)]
    step = -(-nbytes // lanes // LANE_ALIGN) * LANE_ALIGN
    cuts = list(range(0, nbytes, step)) + [nbytes]
    return list(zip(cuts, cuts[1:]))


def read(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, device, lanes: int = 1,
         ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """A copy, on `device`, of the tensor at `offset` of a mapped pool; complete when this returns.

    The copy runs on a stream of its own and only it is waited for: the producer finished writing before it
    sent the ref, so nothing queued in this process need come first, and a stage whose engine keeps the
    device busy (a talker step, a thinker step) does not hold up the thread that takes in its inputs.
    From another GPU, a large tensor may be copied in `lanes` parts on as many stream pairs at once, for
    more copy engines on the link than one copy uses (transport.read_lanes). With the producer's `ready` event
    (its copy into the pool may still run), the copies wait for it on the device first."""
    target = torch.device(device)
    parts = lane_bounds(nbytes, lanes) if target.type == "cuda" and target != buffer.device else [(0, nbytes)]
    if len(parts) > 1:
        return _read_lanes(buffer[offset:offset + nbytes], parts, target, ready).view(dtype).reshape(shape)
    source = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
    # From another GPU, torch copies on the source GPU's current stream after the target's current stream: both
    # are the transport's here, or the copy would wait for whatever this process queued on the default ones.
    streams = [_stream(buffer.device)] + ([_stream(target)] if target.type == "cuda" and target != buffer.device else [])
    if ready is not None:
        streams[0].wait_event(ready)
    with contextlib.ExitStack() as on:
        for stream in streams:
            on.enter_context(torch.cuda.stream(stream))
        out = source.to(target, copy=True)
    streams[-1].synchronize()  # the target's stream waits for the copy
    if target.type == "cuda":
        # Allocated on the read stream, used on the consumer's: its memory is not reused before that use is done.
        out.record_stream(torch.cuda.current_stream(target))
    return out


def _read_lanes(source: torch.Tensor, parts: list[tuple[int, int]], target: torch.device,
                ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """`source` (bytes on another GPU) into a new tensor on `target`, each part on its own pair of streams
    (torch copies across GPUs on the source's current stream, after the target's), after `ready` if given."""
    with torch.cuda.stream(_stream(target)):
        out = torch.empty(source.numel(), dtype=torch.uint8, device=target)
    if ready is not None:
        for lane in range(len(parts)):
            _stream(source.device, lane).wait_event(ready)
    for lane, (a, b) in enumerate(parts):
        with torch.cuda.stream(_stream(source.device, lane)), torch.cuda.stream(_stream(target, lane)):
            out[a:b].copy_(source[a:b])
    for lane in range(len(parts)):
        _stream(target, lane).synchronize()
    out.record_stream(torch.cuda.current_stream(target))  # made on lane 0's stream, used on the consumer's
    return out
