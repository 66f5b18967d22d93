"""Preprocess stage: decodes media on a pool of worker processes, hands features on by reference. Processes keep
decoders off the server's interpreter lock, and run side by side on every core given."""

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import NamedTuple
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from omni.stage.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from services.model.spec import OmniSpec
from services.preprocess.media import PCM_ENCODINGS, Features, Preprocessor
from services.runtime import admission
from services.runtime.config import Limits, MeshConfig
from services.runtime.errors import InvalidArgument, OmniError, ResourceExhausted
from services.runtime.metrics import rpc
from services.runtime.server import Stage, add_service, timings
from services.runtime.transport import Transport

KINDS = {"image": common_pb2.MEDIA_KIND_IMAGE, "audio": common_pb2.MEDIA_KIND_AUDIO, "video": common_pb2.MEDIA_KIND_VIDEO}


log = logging.getLogger(__name__)


def prepare(pre: Preprocessor, index: int, item: preprocess_pb2.MediaItem) -> list[Features]:
    """The item's features: one, or a video's and then its soundtrack's (use_audio_in_video)."""
    where = f"media item {index}"
    kind = item.WhichOneof("content")
    if kind == "image":
        return [pre.image(item.image.data, where)]
    if kind == "video":
        v = item.video
        if v.file and v.frames:
            raise InvalidArgument(f"{where}: a video has either frames or a file, not both")
        if v.use_audio_in_video and not v.file:
            raise InvalidArgument(f"{where}: use_audio_in_video needs a video file (frames have no sound)")
        if not v.file:
            return [pre.video([f.data for f in v.frames], v.fps, where)]
        video = pre.video_file(v.file, v.fps, where, sound=v.use_audio_in_video)
        return [video, pre.soundtrack(video, where)] if v.use_audio_in_video else [video]
    if kind == "audio":
        source = item.audio.WhichOneof("source")
        if source == "file":
            return [pre.audio_file(item.audio.file, where)]
        if source == "pcm":
            p = item.audio.pcm
            return [pre.audio_pcm(p.data, p.sample_rate, PCM_ENCODINGS.get(p.encoding, ""), p.channels, where)]
        raise InvalidArgument(f"{where}: audio has neither a file nor PCM")
    raise InvalidArgument(f"{where}: empty media item")


# -- worker processes: each builds its own Preprocessor once --------------------------------------

_WORKER: Preprocessor | None = None


def _init_worker(model_dir, limits, n_window, context, parent: int) -> None:
    global _WORKER
    die_with_parent(parent)
    single_threaded()
    _WORKER = Preprocessor(model_dir, limits, n_window, context)


def die_with_parent(parent: int) -> None:
    """A worker is killed when its stage process dies, even by SIGKILL (PR_SET_PDEATHSIG): no orphan holds its memory."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # the stage died before the request above
        os._exit(1)


def single_threaded() -> None:
    """One thread per decoder: torch's intra-op threads on top of the pool's fight over the cores, many times slower."""
    torch.set_num_threads(1)


def _ready() -> bool:
    return _WORKER is not None


def _prepare_in_worker(index: int, item: bytes) -> list[Features]:
    return prepare(_WORKER, index, preprocess_pb2.MediaItem.FromString(item))


class PreprocessServicer(preprocess_pb2_grpc.PreprocessServicer):
    def __init__(self, pre: "Preprocessor | WorkerSetup", transport: Transport, workers: int,
                 slots: int = admission.UNSIZED_SLOTS):
        """`slots`: calls decoded or waiting for a worker at once (admission.stage_slots); a bounded queue behind."""
        self.pre, self.transport, self.workers = pre, transport, workers
        self.gate = admission.Gate("preprocess", slots)
        self.pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        args = (self.pre.model_dir, self.pre.limits, self.pre.n_window, self.pre.context, os.getpid())
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=args)

    async def start(self) -> None:
        """Starts every worker process before the stage says it is serving (their imports take seconds)."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.pool, _ready) for _ in range(2 * self.workers)))

    async def _run(self, index: int, item: preprocess_pb2.MediaItem) -> list[Features]:
        payload = item.SerializeToString()
        for attempt in (0, 1):
            pool = self.pool
            try:
                return await asyncio.wrap_future(pool.submit(_prepare_in_worker, index, payload))
            except BrokenProcessPool:
                # A new pool and one more try: an item that kills its worker fails alone after two
                if self.pool is pool:
                    log.error("a preprocess worker process died; starting a new pool")
                    self.pool = self._new_pool()
                    pool.shutdown(wait=False, cancel_futures=True)
        raise OmniError(f"media item {index}: the preprocess worker died twice while preparing it")

    @rpc
    async def Process(self, request, context):
        if len(request.items) > self.pre.limits.max_media_items:
            raise ResourceExhausted(f"{len(request.items)} media items is over the limit of {self.pre.limits.max_media_items}")
        async with self.gate.enter(admission.time_left()):
            t0 = time.perf_counter()
            done = await asyncio.gather(*(self._run(i, it) for i, it in enumerate(request.items)))
        reply = preprocess_pb2.PreprocessResponse(timings=timings(preprocess=time.perf_counter() - t0))
        for f in (f for item in done for f in item):
            ref = self.transport.put(torch.from_numpy(f.values), request.placement)
            reply.items.append(preprocess_pb2.Features(
                kind=KINDS[f.kind], values=ref,
                grid_thw=list(f.grid_thw or ()), feature_length=f.feature_length,
                second_per_grid=f.second_per_grid, num_tokens=f.num_tokens,
                with_audio=f.with_audio, exact_second_per_grid=f.second_per_grid,
            ))
        return reply


class WorkerSetup(NamedTuple):
    """What the workers build their Preprocessor from: this process decodes nothing, so builds none (a restart
    serves seconds sooner)."""
    model_dir: str
    limits: Limits
    n_window: int
    context: int


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    single_threaded()  # this process only moves bytes: threads per core would spin between copies
    spec = OmniSpec.load(cfg.model.dir)
    pre = WorkerSetup(cfg.model.dir, cfg.limits, spec.n_window, cfg.limits.max_context_tokens or spec.max_positions)
    transport = Transport(cfg.transport, f"preprocess{replica}")
    servicer = PreprocessServicer(pre, transport, cfg.preprocess.workers, admission.stage_slots(cfg, "preprocess"))
    await servicer.start()
    name = add_service(server, servicer, preprocess_pb2.DESCRIPTOR.services_by_name["Preprocess"])

    async def close():
        servicer.pool.shutdown(cancel_futures=True)
        transport.close()

    return Stage(services=[name], close=close)
