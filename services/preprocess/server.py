"""Preprocess stage: decodes and prepares media on a pool of threads, hands features on by reference."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from omni.stage.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from omni.v1 import omni_pb2
from services.model.spec import OmniSpec
from services.preprocess.media import Features, Preprocessor
from services.runtime.config import MeshConfig
from services.runtime.errors import InvalidArgument, ResourceExhausted
from services.runtime.metrics import rpc
from services.runtime.protoconv import timings
from services.runtime.server import Stage, add_service
from services.runtime.transport import Transport

KINDS = {"image": common_pb2.MEDIA_KIND_IMAGE, "audio": common_pb2.MEDIA_KIND_AUDIO, "video": common_pb2.MEDIA_KIND_VIDEO}
PCM = {omni_pb2.PCM_ENCODING_S16LE: "s16le", omni_pb2.PCM_ENCODING_F32LE: "f32le"}


class PreprocessServicer(preprocess_pb2_grpc.PreprocessServicer):
    def __init__(self, pre: Preprocessor, transport: Transport, workers: int):
        self.pre, self.transport = pre, transport
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="preprocess")

    def _one(self, index: int, item: preprocess_pb2.MediaItem) -> Features:
        where = f"media item {index}"
        kind = item.WhichOneof("content")
        if kind == "image":
            return self.pre.image(item.image.data, where)
        if kind == "video":
            return self.pre.video([f.data for f in item.video.frames], item.video.fps, where)
        if kind == "audio":
            source = item.audio.WhichOneof("source")
            if source == "file":
                return self.pre.audio_file(item.audio.file, where)
            if source == "pcm":
                p = item.audio.pcm
                return self.pre.audio_pcm(p.data, p.sample_rate, PCM.get(p.encoding, ""), p.channels, where)
            raise InvalidArgument(f"{where}: audio has neither a file nor PCM")
        raise InvalidArgument(f"{where}: empty media item")

    @rpc
    async def Process(self, request, context):
        if len(request.items) > self.pre.limits.max_media_items:
            raise ResourceExhausted(f"{len(request.items)} media items is over the limit of {self.pre.limits.max_media_items}")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(loop.run_in_executor(self.pool, self._one, i, it) for i, it in enumerate(request.items)))
        reply = preprocess_pb2.PreprocessResponse(timings=timings(preprocess=time.perf_counter() - t0))
        for f in done:
            reply.items.append(preprocess_pb2.Features(
                kind=KINDS[f.kind], values=self.transport.put(torch.from_numpy(f.values), request.placement),
                grid_thw=list(f.grid_thw or ()), feature_length=f.feature_length,
                second_per_grid=f.second_per_grid, num_tokens=f.num_tokens,
            ))
        return reply


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    r = cfg.preprocess.replicas[replica]
    pre = Preprocessor(cfg.model.dir, cfg.limits, OmniSpec.load(cfg.model.dir).n_window)
    transport = Transport(cfg.transport, f"preprocess{replica}", r.shm_domain)
    servicer = PreprocessServicer(pre, transport, cfg.preprocess.workers)
    name = add_service(server, servicer, preprocess_pb2.DESCRIPTOR.services_by_name["Preprocess"])

    async def close():
        servicer.pool.shutdown(cancel_futures=True)
        transport.close()

    return Stage(services=[name], close=close)
