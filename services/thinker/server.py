"""Thinker stage: gRPC in front of a thinker engine. Every request is checked here, so a caller that reaches the
stage directly is held to what the gateway holds it to, and one bad request cannot fail a step of others."""

import math

import torch

from omni.stage.v1 import thinker_pb2, thinker_pb2_grpc
from services.llm.sampling import check_ids, check_params, sampling_from_proto
from services.model.spec import OmniSpec
from services.runtime.config import MeshConfig
from services.runtime.errors import InvalidArgument
from services.runtime.metrics import QUEUE_WAIT, TOKENS, rpc
from services.runtime.server import Stage, engine_stage, timings
from services.runtime.transport import Transport
from services.runtime.worker import EngineWorker
from services.thinker.engine import NativeThinker
from services.thinker.reference import ReferenceThinker
from services.thinker.seq import Span, ThinkerSeq

STOP_REASONS = {"eos": thinker_pb2.STOP_REASON_EOS, "length": thinker_pb2.STOP_REASON_LENGTH}


class ThinkerServicer(thinker_pb2_grpc.ThinkerServicer):
    def __init__(self, worker: EngineWorker, transport: Transport, device: str, vocab: int, context: int,
                 max_new_tokens: int):
        self.worker, self.transport, self.device = worker, transport, device
        self.vocab, self.context, self.max_new_tokens = vocab, context, max_new_tokens

    def _check(self, req: thinker_pb2.ThinkerRequest):
        """The request's sizes and values, before any tensor is made of them -> its sampling parameters."""
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidArgument("prompt_ids is empty")
        params = sampling_from_proto(req.sampling)
        check_params(params, self.vocab, self.max_new_tokens)
        if n + params.max_tokens > self.context:
            raise InvalidArgument(f"prompt_ids of {n} tokens + sampling.max_tokens {params.max_tokens} is past the "
                                  f"context of {self.context}")
        if req.positions and len(req.positions) != 3 * n:
            raise InvalidArgument(f"positions has {len(req.positions)} values, 3 x {n} expected")
        if not math.isfinite(req.rope_delta):
            raise InvalidArgument("rope_delta must be finite")
        if len(req.embed_token_ids) > self.context:
            raise InvalidArgument(f"embed_token_ids has {len(req.embed_token_ids)} ids, more than the context")
        return params

    def _seq(self, req: thinker_pb2.ThinkerRequest) -> ThinkerSeq:
        params = self._check(req)
        prompt = check_ids(req.prompt_ids, self.vocab, "prompt_ids")
        check_ids(req.embed_token_ids, self.vocab, "embed_token_ids")
        positions = None
        if req.positions:
            positions = torch.tensor(req.positions, dtype=torch.float32).view(3, len(prompt))
            if not bool(positions.isfinite().all()):
                raise InvalidArgument("positions must be finite")
        spans = [piece for s in req.spans for piece in self._span(s, len(prompt))]
        return ThinkerSeq(
            request_id=req.request_id, prompt_ids=prompt, params=params, positions=positions, rope_delta=req.rope_delta, spans=spans,
            return_states=req.return_states, embed_token_ids=list(req.embed_token_ids),
        )

    def _span(self, s: thinker_pb2.MultimodalSpan, n: int) -> list[Span]:
        """One span's rows, read once, as a Span per run they fill (views of the rows, not copies)."""
        embeds = self.transport.get(s.embeds, self.device)  # read first: a refused span's slots are freed too
        deepstack = [self.transport.get(d, self.device) for d in s.deepstack]
        if len(s.runs) % 2 or any(r < 0 or r > n for r in s.runs):
            raise InvalidArgument(f"span runs must be (offset, rows) pairs within the prompt of {n}, got {list(s.runs)}")
        runs = list(zip(s.runs[::2], s.runs[1::2])) or [(s.offset, len(embeds))]
        if sum(rows for _, rows in runs) != len(embeds):
            raise InvalidArgument(f"span runs cover {sum(rows for _, rows in runs)} rows of {len(embeds)}")
        out, row = [], 0
        for offset, rows in runs:
            out.append(Span(offset, embeds[row:row + rows], [d[row:row + rows] for d in deepstack]))
            row += rows
        return out

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
    spec = OmniSpec.load(cfg.model.dir)
    vocab, context = spec.thinker["text_config"]["vocab_size"], cfg.limits.max_context_tokens or spec.max_positions
    return engine_stage(server, "thinker", cfg, replica, engine,
                        lambda w, t: ThinkerServicer(w, t, r.device, vocab, context, cfg.limits.max_new_tokens),
                        thinker_pb2.DESCRIPTOR.services_by_name["Thinker"], exports_gpu_tensors=True)
