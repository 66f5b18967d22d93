"""Thinker stage: gRPC in front of a thinker engine."""

import torch

from omni.stage.v1 import thinker_pb2, thinker_pb2_grpc
from services.runtime.config import MeshConfig
from services.runtime.errors import InvalidArgument
from services.runtime.metrics import QUEUE_WAIT, TOKENS, rpc
from services.runtime.protoconv import sampling_from_proto, timings
from services.runtime.server import Stage, engine_stage
from services.runtime.transport import Transport
from services.runtime.worker import EngineWorker
from services.thinker.engine import NativeThinker
from services.thinker.reference import ReferenceThinker
from services.thinker.seq import Span, ThinkerSeq

STOP_REASONS = {"eos": thinker_pb2.STOP_REASON_EOS, "length": thinker_pb2.STOP_REASON_LENGTH}


class ThinkerServicer(thinker_pb2_grpc.ThinkerServicer):
    def __init__(self, worker: EngineWorker, transport: Transport, device: str):
        self.worker, self.transport, self.device = worker, transport, device

    def _seq(self, req: thinker_pb2.ThinkerRequest) -> ThinkerSeq:
        n = len(req.prompt_ids)
        positions = None
        if req.positions:
            if len(req.positions) != 3 * n:
                raise InvalidArgument(f"positions has {len(req.positions)} values, 3 x {n} expected")
            positions = torch.tensor(req.positions, dtype=torch.float32).view(3, n)
        if req.sampling.max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens must be at least 1")
        spans = [
            Span(s.offset, self.transport.get(s.embeds, self.device), [self.transport.get(d, self.device) for d in s.deepstack])
            for s in req.spans
        ]
        return ThinkerSeq(
            request_id=req.request_id, prompt_ids=torch.tensor(req.prompt_ids, dtype=torch.long),
            params=sampling_from_proto(req.sampling), positions=positions, rope_delta=req.rope_delta, spans=spans,
            return_states=req.return_states, embed_token_ids=list(req.embed_token_ids),
        )

    @rpc
    async def Generate(self, request, context):
        seq = self._seq(request)
        handle = self.worker.submit(seq)
        finished = False
        try:
            async for step in handle.outputs():
                out = thinker_pb2.ThinkerOutput(token_ids=step.token_ids)
                TOKENS.labels("thinker").inc(len(step.token_ids))
                if step.embeds is not None:  # both in one slot: one ref, one read at the talker
                    out.state_start = step.state_start
                    out.states.CopyFrom(self.transport.put([step.embeds, step.hidden], request.placement, step.ready))
                if step.token_embeds is not None:
                    out.token_embeds.CopyFrom(self.transport.put(step.token_embeds, request.placement, step.ready))
                if step.stop_reason:
                    out.stop_reason = STOP_REASONS[step.stop_reason]
                    out.prompt_tokens = len(seq.prompt_ids)
                    wait = max(seq.started - seq.arrived, 1e-9) if seq.started else 0.0
                    if wait:
                        QUEUE_WAIT.labels("thinker").observe(wait)
                    out.timings.extend(timings(thinker_wait=wait, thinker_prefill=seq.prefill_seconds,
                                               thinker_decode=seq.decode_seconds))
                yield out
            finished = True
        finally:
            if not finished:
                self.worker.cancel(handle)


def make_engine(cfg: MeshConfig, device: str):
    if cfg.thinker.engine == "native":
        return NativeThinker(cfg.model, cfg.thinker, device)
    return ReferenceThinker(cfg.model, device)


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    r = cfg.thinker.replicas[replica]
    engine = make_engine(cfg, r.device)
    return engine_stage(server, "thinker", cfg, replica, engine, lambda w, t: ThinkerServicer(w, t, r.device),
                        thinker_pb2.DESCRIPTOR.services_by_name["Thinker"], exports_gpu_tensors=True)
