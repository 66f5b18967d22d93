"""One request across the stages: preprocess -> prompt -> encode -> thinker, with the talker fed from
the thinker's stream as it comes, and both outputs merged into the client's stream as they are made."""

import asyncio
import io
import time
import uuid
import wave
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field

import numpy as np

from omni.stage.v1 import (
    common_pb2, encoder_pb2, encoder_pb2_grpc, preprocess_pb2, preprocess_pb2_grpc, talker_pb2, talker_pb2_grpc,
    tensor_pb2, thinker_pb2, thinker_pb2_grpc,
)
from omni.v1 import omni_pb2
from services.gateway.audio_out import ENCODINGS, AudioEncoder
from services.gateway.detok import Detokenizer
from services.gateway.prompt import MediaRef, PromptBuilder
from services.gateway.router import LOAD_POLL_S, Endpoint, Router
from services.gateway.validate import Resolved, check_context, resolve
from services.llm.sampling import sampling_to_proto
from services.model.media_tokens import MediaSizes
from services.model.spec import OmniSpec
from services.runtime.admission import Gate, slots
from services.runtime.config import MeshConfig
from services.runtime.errors import InvalidArgument
from services.runtime.transport import SHM_DOMAIN

MEDIA_KINDS = {common_pb2.MEDIA_KIND_IMAGE: "image", common_pb2.MEDIA_KIND_AUDIO: "audio", common_pb2.MEDIA_KIND_VIDEO: "video"}
SAMPLE_RATE = 24000
# Outputs a request's stream holds unread (a few chunks of speech): past that the client is not reading, and the
# gateway stops pulling from the stages
STREAM_BOUND = 8


def _placement(endpoint: Endpoint | None, shm: bool) -> tensor_pb2.Placement:
    """Where a stage will read what the call produces, so the producer picks a transport it can use."""
    if endpoint is None:
        return tensor_pb2.Placement()
    return tensor_pb2.Placement(shm_domain=SHM_DOMAIN if shm else "", cuda=endpoint.replica.device.startswith("cuda"))


def wav_bytes(pcm16: bytes, rate: int = SAMPLE_RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)
    return buf.getvalue()


@contextmanager
def _cancelling(call):
    """A stage call cancelled however its caller leaves it: waiting for the client's stream is not in the call."""
    try:
        yield call
    finally:
        call.cancel()


class Outbox:
    """One request's queue between its tasks: `put` waits while `bound` items are unread; `put_last` (an end, an
    error) never waits."""

    def __init__(self, bound: int = STREAM_BOUND):
        self._items: asyncio.Queue = asyncio.Queue()
        self._room = asyncio.Semaphore(bound)

    async def put(self, item) -> None:
        await self._room.acquire()
        self._items.put_nowait((True, item))

    def put_last(self, item) -> None:
        self._items.put_nowait((False, item))

    async def get(self):
        counted, item = await self._items.get()
        if counted:
            self._room.release()
        return item


@dataclass
class Progress:
    """What one request has produced so far, for its final Usage."""
    t0: float
    timeout: float | None = None  # the client's deadline, from t0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_samples: int = 0
    audio_frames: int = 0
    first_token: float = 0.0
    first_audio: float = 0.0
    reason: int = omni_pb2.FINISH_REASON_UNSPECIFIED
    timings: dict = field(default_factory=dict)

    def left(self) -> float | None:
        """Seconds to the client's deadline, for every call made on the request's behalf."""
        return None if self.timeout is None else max(0.0, self.t0 + self.timeout - time.perf_counter())

    def add_timings(self, items) -> None:
        for t in items:
            self.timings[t.stage] = self.timings.get(t.stage, 0.0) + t.seconds

    def usage(self) -> omni_pb2.Usage:
        """What the request has used so far: all of it once finished, up to the cut if it was stopped."""
        return omni_pb2.Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            audio_seconds=self.audio_samples / SAMPLE_RATE, audio_frames=self.audio_frames,
            time_to_first_token_seconds=self.first_token, time_to_first_audio_seconds=self.first_audio,
            timings=[omni_pb2.StageTiming(stage=k, seconds=v) for k, v in self.timings.items()]
            + [omni_pb2.StageTiming(stage="total", seconds=time.perf_counter() - self.t0)],
        )


class Gateway:
    def __init__(self, cfg: MeshConfig):
        self.cfg = cfg
        self.spec = OmniSpec.load(cfg.model.dir)
        self.prompts = PromptBuilder(cfg.model.dir, self.spec)
        self.sizes = MediaSizes.load(cfg.model.dir, self.spec.n_window)
        poll, routing, sec = LOAD_POLL_S, cfg.gateway.routing, cfg.security
        self.preprocess = Router(cfg.preprocess.replicas, preprocess_pb2_grpc.PreprocessStub, poll_s=poll,
                                 stage="preprocess", security=sec)
        self.encoders = Router(cfg.encoder.replicas, encoder_pb2_grpc.EncoderStub, routing == "modality", poll,
                               routing == "fixed", stage="encoder", security=sec)
        self.thinkers = Router(cfg.thinker.replicas, thinker_pb2_grpc.ThinkerStub, routing == "modality", poll,
                               routing == "fixed", stage="thinker", security=sec)
        has_talker = bool(cfg.talker.replicas) and self.spec.has_talker
        self.talkers = Router(cfg.talker.replicas, talker_pb2_grpc.TalkerStub, poll_s=poll, stage="talker",
                              security=sec) if has_talker else None
        self.max_context = cfg.limits.max_context_tokens or self.spec.max_positions
        self.tts_ids = [self.spec.raw[k] for k in ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id")]
        # What the engines behind hold at once, every replica's; a speech request takes a slot of each
        self.thinker_gate = Gate("the thinker", slots(cfg.thinker) * len(cfg.thinker.replicas))
        self.talker_gate = Gate("the talker", slots(cfg.talker) * len(cfg.talker.replicas)) if has_talker else None

    async def close(self) -> None:
        for router in (self.preprocess, self.encoders, self.thinkers, self.talkers):
            if router is not None:
                await router.close()

    def model_info(self) -> omni_pb2.ModelInfo:
        lim = self.cfg.limits
        outputs = [omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if self.talkers else [])
        return omni_pb2.ModelInfo(
            model=self.cfg.model.name, input_modalities=["text", "image", "audio", "video"], output_modalities=outputs,
            voices=sorted(self.spec.voices) if self.talkers else [], default_voice=self.spec.default_voice if self.talkers else "",
            audio_sample_rate=SAMPLE_RATE,
            limits=omni_pb2.Limits(
                max_request_bytes=lim.max_request_bytes, max_media_items=lim.max_media_items, max_image_pixels=lim.max_image_pixels,
                max_audio_seconds=lim.max_audio_seconds, max_video_frames=lim.max_video_frames,
                max_context_tokens=self.max_context, max_new_tokens=lim.max_new_tokens,
            ),
        )

    async def generate(self, req: omni_pb2.GenerateRequest, timeout: float | None, progress: Progress | None = None):
        """`progress`, when given, is the caller's view of what the request used, read when it stops the request."""
        progress = progress or Progress(time.perf_counter(), timeout)
        self.thinker_gate.refuse_early(timeout)
        r = resolve(req, self.spec, self.cfg.limits, self.talkers is not None, self.prompts.check_text)
        # Off the event loop, and outside the gate: a request past the context waits for no slot to be refused
        ids = await asyncio.to_thread(check_context, r, self.prompts, self.sizes, self.cfg.limits, self.max_context)
        async with self.thinker_gate.enter(progress.left()):
            if not r.want_audio:
                async with aclosing(self._generate(req, r, ids, progress)) as responses:
                    async for response in responses:
                        yield response
                return
            async with self.talker_gate.enter(progress.left()), aclosing(self._generate(req, r, ids, progress)) as responses:
                async for response in responses:
                    yield response

    async def _generate(self, req: omni_pb2.GenerateRequest, r: Resolved, ids: list[int], progress: Progress):
        rid = req.request_id or uuid.uuid4().hex
        thinker_ep = self.thinkers.pick("audio" if r.want_audio else "text")
        talker_ep = self.talkers.pick() if r.want_audio else None
        spans, prompt = await self._prompt(rid, r, ids, thinker_ep, progress)
        progress.prompt_tokens = len(prompt.ids)
        treq = thinker_pb2.ThinkerRequest(
            request_id=rid, prompt_ids=prompt.ids, positions=prompt.positions.reshape(-1).tolist(), rope_delta=prompt.rope_delta,
            spans=spans, sampling=sampling_to_proto(r.thinker), return_states=r.want_audio, placement=_placement(talker_ep, self.cfg.transport.shm),
            embed_token_ids=self.tts_ids if r.want_audio else [],
        )
        events = Outbox()
        talker_inputs = Outbox() if r.want_audio else None
        start = None if talker_ep is None else talker_pb2.TalkerStart(
            request_id=rid, prompt_ids=prompt.ids, voice=r.voice, sampling=sampling_to_proto(r.talker),
            layout=common_pb2.MediaLayout(
                image_grid_thw=[x for g3 in prompt.layout.image_grid_thw for x in g3],
                video_grid_thw=[x for g3 in prompt.layout.video_grid_thw for x in g3],
                video_second_per_grid=prompt.layout.video_second_per_grid, audio_feature_lengths=prompt.audio_feature_lengths,
            ),
        )
        tasks = [asyncio.create_task(self._guard(events, self._thinker(treq, thinker_ep, r, start, talker_inputs, events, progress)))]
        if talker_ep is not None:
            tasks.append(asyncio.create_task(self._guard(events, self._talker(talker_ep, talker_inputs, r, events, progress))))
        running = len(tasks)
        try:
            while running:
                kind, payload = await events.get()
                if kind == "done":
                    running -= 1
                elif kind == "error":
                    raise payload
                else:
                    yield omni_pb2.GenerateResponse(request_id=rid, **{kind: payload})
        finally:
            for t in tasks:
                t.cancel()
        finished = omni_pb2.Finished(reason=progress.reason, usage=progress.usage())
        yield omni_pb2.GenerateResponse(request_id=rid, finished=finished)

    def _build_prompt(self, r: Resolved, ids: list[int], media: list[MediaRef]):
        prompt = self.prompts.build(ids, media)
        if len(prompt.ids) + r.thinker.max_tokens > self.max_context:
            raise InvalidArgument(f"prompt of {len(prompt.ids)} tokens + max_tokens {r.thinker.max_tokens} is past the context of {self.max_context}")
        return prompt

    async def _prompt(self, rid: str, r: Resolved, ids: list[int], thinker_ep: Endpoint, progress: Progress):
        """Preprocess the media, lay out the prompt around them (refused here if the decoded media make it too
        long), then encode."""
        if not r.media:  # laid out off the event loop, which serves every other request meanwhile
            return [], await asyncio.to_thread(self._build_prompt, r, ids, [])
        encoder_ep = self.encoders.pick("audio" if r.want_audio else "text")
        pre_ep = self.preprocess.pick()
        items = [preprocess_pb2.MediaItem(**{type(m).__name__.lower(): m}) for m in r.media]
        t0 = time.perf_counter()
        with self.preprocess.use(pre_ep):
            pre = await pre_ep.stub.Process(
                preprocess_pb2.PreprocessRequest(request_id=rid, items=items, placement=_placement(encoder_ep, self.cfg.transport.shm)), timeout=progress.left())
        progress.add_timings(pre.timings)
        # As the gateway waited (work, queue, messages): beside the stages' own, where a first token waits
        progress.timings["gateway_preprocess"] = time.perf_counter() - t0
        media = [MediaRef(MEDIA_KINDS[f.kind], f.num_tokens, tuple(f.grid_thw) or None, f.feature_length,
                          f.exact_second_per_grid or f.second_per_grid, f.with_audio) for f in pre.items]
        prompt = await asyncio.to_thread(self._build_prompt, r, ids, media)
        t0 = time.perf_counter()
        with self.encoders.use(encoder_ep):
            enc = await encoder_ep.stub.Encode(
                encoder_pb2.EncodeRequest(request_id=rid, items=pre.items, placement=_placement(thinker_ep, self.cfg.transport.shm)), timeout=progress.left())
        progress.add_timings(enc.timings)
        progress.timings["gateway_encode"] = time.perf_counter() - t0
        spans = [thinker_pb2.MultimodalSpan(offset=runs[0][0], embeds=e.embeds, deepstack=e.deepstack,
                                            runs=[x for run in runs for x in run] if len(runs) > 1 else [])
                 for runs, e in zip(prompt.runs, enc.items)]
        return spans, prompt

    @staticmethod
    async def _guard(events: Outbox, body) -> None:
        try:
            await body
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the request's stream reports it
            events.put_last(("error", exc))
        finally:
            events.put_last(("done", None))

    async def _thinker(self, treq, ep: Endpoint, r: Resolved, start, talker_inputs, events, progress: Progress):
        detok = Detokenizer(self.prompts.tokenizer, r.stop)
        with self.thinkers.use(ep):
            call = ep.stub.Generate(treq, timeout=progress.left())
            try:
                async for out in call:
                    if talker_inputs is not None:
                        if out.HasField("token_embeds"):
                            start.tts_embeds.CopyFrom(out.token_embeds)
                            await talker_inputs.put(talker_pb2.TalkerInput(start=start))
                        if out.HasField("states"):
                            await talker_inputs.put(talker_pb2.TalkerInput(states=talker_pb2.ThinkerStates(
                                start=out.state_start, states=out.states)))
                    progress.completion_tokens += len(out.token_ids)
                    if not progress.first_token:
                        progress.first_token = time.perf_counter() - progress.t0
                    text = detok.add(list(out.token_ids))
                    if out.stop_reason:
                        text += detok.flush()
                        progress.reason = omni_pb2.FINISH_REASON_STOP if out.stop_reason == thinker_pb2.STOP_REASON_EOS else omni_pb2.FINISH_REASON_LENGTH
                        progress.add_timings(out.timings)
                    if r.want_text and (text or out.token_ids):
                        await events.put(("text", omni_pb2.TextDelta(text=text, token_ids=out.token_ids)))
                    if detok.stopped:
                        progress.reason = omni_pb2.FINISH_REASON_STOP_STRING
                        call.cancel()
                        break
            finally:
                call.cancel()  # see _cancelling
                if talker_inputs is not None:
                    talker_inputs.put_last(talker_pb2.TalkerInput(end=talker_pb2.TextEnd()))

    async def _talker(self, ep: Endpoint, inputs: Outbox, r: Resolved, events, progress: Progress):
        async def requests():
            while True:
                msg = await inputs.get()
                yield msg
                if msg.HasField("end"):
                    return

        wav_parts, index = [], 0
        encoder = AudioEncoder(r.audio_format, SAMPLE_RATE) if r.audio_format in ENCODINGS else None
        with self.talkers.use(ep), _cancelling(ep.stub.Synthesize(requests(), timeout=progress.left())) as call:
            async for out in call:
                if out.HasField("finished"):
                    progress.audio_frames = out.finished.frames
                    progress.add_timings(out.finished.timings)
                    continue
                chunk = out.chunk
                pcm = np.frombuffer(chunk.pcm, "<f4")
                pcm16 = (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
                start = progress.audio_samples / SAMPLE_RATE
                progress.audio_samples += len(pcm)
                if not progress.first_audio:
                    progress.first_audio = time.perf_counter() - progress.t0
                if r.audio_format == omni_pb2.AUDIO_FORMAT_WAV:
                    wav_parts.append(pcm16)
                    continue
                data = pcm16 if encoder is None else encoder.push(pcm16)
                await events.put(("audio", omni_pb2.AudioChunk(
                    data=data, format=r.audio_format, sample_rate=SAMPLE_RATE, index=index, start_seconds=start,
                    duration_seconds=len(pcm) / SAMPLE_RATE,
                    codec_codes=chunk.codes if r.return_codes else [], num_codebooks=chunk.num_codebooks if r.return_codes else 0,
                )))
                index += 1
        if encoder is not None:
            await events.put(("audio", omni_pb2.AudioChunk(
                data=encoder.close(), format=r.audio_format, sample_rate=SAMPLE_RATE, index=index,
                start_seconds=progress.audio_samples / SAMPLE_RATE)))
        if wav_parts:
            data = b"".join(wav_parts)
            await events.put(("audio", omni_pb2.AudioChunk(
                data=wav_bytes(data), format=omni_pb2.AUDIO_FORMAT_WAV, sample_rate=SAMPLE_RATE, index=0,
                start_seconds=0.0, duration_seconds=len(data) / 2 / SAMPLE_RATE,
            )))
