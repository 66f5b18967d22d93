"""Talker stage: gRPC in front of a talker engine. States stream in, speech streams out. Every request is checked
here, so a caller that reaches the stage directly is held to what the gateway holds it to."""

import asyncio

import torch

from omni.stage.v1 import common_pb2, talker_pb2, talker_pb2_grpc
from services.llm.sampling import check_ids, check_params, sampling_from_proto
from services.model.positions import Layout
from services.model.spec import OmniSpec, audio_tokens
from services.runtime.config import Limits, MeshConfig
from services.runtime.errors import InvalidArgument
from services.runtime.metrics import QUEUE_WAIT, TOKENS, rpc
from services.runtime.server import Stage, engine_stage, timings
from services.runtime.transport import Transport
from services.runtime.worker import EngineWorker
from services.talker.engine import NativeTalker
from services.talker.reference import ReferenceTalker
from services.talker.seq import TalkerSeq


def layout_from_proto(msg: common_pb2.MediaLayout, audio: list[int]) -> Layout:
    """The prompt's media layout as the thinker's M-RoPE saw it; `audio`: each clip's tokens."""
    def triples(flat):
        return [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]

    return Layout(
        image_grid_thw=triples(list(msg.image_grid_thw)), video_grid_thw=triples(list(msg.video_grid_thw)),
        video_second_per_grid=list(msg.video_second_per_grid), audio_tokens=audio,
    )


class TalkerServicer(talker_pb2_grpc.TalkerServicer):
    def __init__(self, worker: EngineWorker, engine, transport: Transport, spec: OmniSpec, limits: Limits):
        self.worker, self.engine, self.transport, self.spec, self.limits = worker, engine, transport, spec, limits
        self.context = limits.max_context_tokens or spec.max_positions

    def _check(self, start: talker_pb2.TalkerStart):
        """The request's sizes and values, before any tensor is made of them -> its sampling parameters."""
        voice = start.voice.lower() or self.spec.default_voice
        if voice not in self.spec.voices:
            raise InvalidArgument(f"unknown voice {start.voice}; known: {', '.join(sorted(self.spec.voices))}")
        n = len(start.prompt_ids)
        if not n:
            raise InvalidArgument("prompt_ids is empty")
        if n > self.context:
            raise InvalidArgument(f"prompt_ids of {n} tokens is past the context of {self.context}")
        params = sampling_from_proto(start.sampling)
        check_params(params, self.spec.talker["text_config"]["vocab_size"], self.limits.max_talker_frames)
        lengths = start.layout.audio_feature_lengths
        if any(not 0 <= f <= self.context * 8 for f in lengths):  # 100 mel frames a second make 13 tokens
            raise InvalidArgument("layout.audio_feature_lengths must be at least 0 and fit the context")
        merge = self.spec.thinker["vision_config"]["spatial_merge_size"]
        for name in ("image_grid_thw", "video_grid_thw"):
            flat = list(getattr(start.layout, name))
            grids = [flat[i:i + 3] for i in range(0, len(flat), 3)]
            if len(flat) % 3 or any(min(g) < 1 or g[0] * g[1] * g[2] > self.context * merge**2 for g in grids):
                raise InvalidArgument(f"layout.{name} must be (t, h, w) triples of at least 1 that fit the context")
        return voice, params

    def _seq(self, start: talker_pb2.TalkerStart) -> TalkerSeq:
        voice, params = self._check(start)
        prompt = check_ids(start.prompt_ids, self.spec.thinker["text_config"]["vocab_size"], "prompt_ids")
        n_window = self.spec.n_window
        layout = layout_from_proto(start.layout, [audio_tokens(n, n_window) for n in start.layout.audio_feature_lengths])
        return TalkerSeq(
            request_id=start.request_id, prompt_ids=prompt, layout=layout,
            speaker_id=self.spec.voices[voice], params=params,
            tts_embeds=self._tts_embeds(start.tts_embeds),
        )

    def _tts_embeds(self, ref) -> torch.Tensor:
        if list(ref.shape) != [3, self.spec.thinker_hidden]:  # a step reads them beside other requests' rows
            raise InvalidArgument(f"tts_embeds of shape {list(ref.shape)}: expected [3, {self.spec.thinker_hidden}]")
        return self.transport.get(ref, self.engine.device)

    async def _feed(self, inputs, seq: TalkerSeq, handle) -> None:
        """The thinker's states into the request in order; after the speech, released unread until the text ends."""
        expected = 0
        try:
            async for msg in inputs:
                if msg.HasField("states") and seq.done:
                    self.transport.release(msg.states.states)
                elif msg.HasField("states"):
                    s = msg.states
                    if s.start != expected:
                        raise InvalidArgument(f"thinker states out of order: position {s.start}, expected {expected}")
                    shape = list(s.states.shape)
                    if len(shape) != 3 or shape[0] != 2 or shape[2] != self.spec.thinker_hidden:
                        raise InvalidArgument(f"thinker states of shape {shape}: expected "
                                              f"[2, rows, {self.spec.thinker_hidden}]")
                    if expected + shape[1] > self.context:
                        raise InvalidArgument(f"thinker states past position {self.context}, the context")
                    # Host states stay on the host for the engine to upload; a CUDA IPC ref is on a GPU already
                    where = self.engine.device if s.states.WhichOneof("location") == "cuda" else "cpu"
                    both = self.transport.get(s.states, where)
                    expected += both.shape[1]
                    seq.inbox.append((both[0], both[1]))
                elif msg.HasField("end"):
                    break
                self.worker.notify()
        except Exception as exc:  # noqa: BLE001 - out-of-order states, an unreadable ref: this request fails alone
            handle.post(exc)
        finally:
            seq.text_ended = True
            self.worker.notify()

    @rpc
    async def Synthesize(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            raise InvalidArgument("the first message must be a TalkerStart")
        seq = self._seq(first.start)
        handle = self.worker.submit(seq)
        feeder = asyncio.create_task(self._feed(request_iterator, seq, handle))
        finished = False
        try:
            async for step in handle.outputs():
                for chunk in step.chunks:
                    TOKENS.labels("talker").inc(len(chunk.codes))
                    yield talker_pb2.TalkerOutput(chunk=talker_pb2.SpeechChunk(
                        pcm=chunk.pcm.astype("<f4").tobytes(), sample_rate=self.engine.sample_rate,
                        codes=[c for frame in chunk.codes for c in frame], num_codebooks=self.engine.groups,
                        first_frame=chunk.first_frame,
                    ))
                if step.finished:
                    split = seq.first_audio_split()
                    if "talker_queue" in split:
                        QUEUE_WAIT.labels("talker").observe(split["talker_queue"])
                    yield talker_pb2.TalkerOutput(finished=talker_pb2.TalkerFinished(
                        frames=len(seq.frames), eos=seq.eos, timings=timings(**seq.seconds, **split),
                    ))
            finished = True
            await feeder  # the rest of the caller's stream, released unread (see _feed)
        finally:
            feeder.cancel()
            if not finished:
                self.worker.cancel(handle)


def make_engine(cfg: MeshConfig, device: str):
    if cfg.talker.engine == "native":
        return NativeTalker(cfg.model, cfg.talker, device)
    return ReferenceTalker(cfg.model, cfg.talker, device)


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    r = cfg.talker.replicas[replica]
    engine = make_engine(cfg, r.device)
    spec = OmniSpec.load(cfg.model.dir)
    return engine_stage(server, "talker", cfg, replica, engine, lambda w, t: TalkerServicer(w, engine, t, spec, cfg.limits),
                        talker_pb2.DESCRIPTOR.services_by_name["Talker"])
