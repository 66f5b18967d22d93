"""Encoder stage: features in, embeddings (and DeepStack taps) out, by reference."""

from omni.stage.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.encoder.engine import EncodeJob, Encoder, Item
from services.runtime.config import MeshConfig
from services.runtime.metrics import QUEUE_WAIT, rpc
from services.runtime.server import Stage, engine_stage, timings
from services.runtime.transport import Transport
from services.runtime.worker import EngineWorker

KINDS = {common_pb2.MEDIA_KIND_IMAGE: "image", common_pb2.MEDIA_KIND_AUDIO: "audio", common_pb2.MEDIA_KIND_VIDEO: "video"}


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, worker: EngineWorker, transport: Transport, device: str):
        self.worker, self.transport, self.device = worker, transport, device

    @rpc
    async def Encode(self, request, context):
        items = [Item(KINDS.get(f.kind, "unknown"), self.transport.get(f.values, self.device), tuple(f.grid_thw) or None)
                 for f in request.items]
        job = EncodeJob(items)
        handle = self.worker.submit(job)
        finished = False
        try:
            encoded = [out async for out in handle.outputs()][0]
            finished = True
        finally:
            if not finished:
                self.worker.cancel(handle)
        wait = max(job.started - job.submitted, 1e-9)
        QUEUE_WAIT.labels("encoder").observe(wait)
        reply = encoder_pb2.EncodeResponse(timings=timings(encode=job.seconds, encode_wait=wait))
        for item, enc in zip(request.items, encoded):
            reply.items.append(encoder_pb2.Embedding(
                kind=item.kind, embeds=self.transport.put(enc.embeds, request.placement, enc.ready),
                deepstack=[self.transport.put(d, request.placement, enc.ready) for d in enc.deepstack],
            ))
        return reply


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    r = cfg.encoder.replicas[replica]
    engine = Encoder(cfg.model, r.device)
    if engine.device.type == "cuda":
        engine.warm()
    return engine_stage(server, "encoder", cfg, replica, engine, lambda w, t: EncoderServicer(w, t, r.device),
                        encoder_pb2.DESCRIPTOR.services_by_name["Encoder"], exports_gpu_tensors=True)
