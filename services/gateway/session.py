"""One Converse session: the client's events read as they come, each committed user turn answered by the gateway's
Generate over the conversation so far, answers stopped by a cancel or by the user speaking over them, and the
conversation kept within a token budget, oldest turns dropped first; the client may delete its items and cut an
answer to what was heard."""

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from omni.v1 import omni_pb2
from services.gateway.history import Exchange, History
from services.gateway.orchestrator import SAMPLE_RATE, Outbox, Progress
from services.gateway.validate import resolve
from services.gateway.vad import AGGRESSIVENESS, FRAME_MS, RATE, SILENCE_MS, SPEECH_MS, InputAudio, TurnDetector
from services.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, OmniError, ResourceExhausted
from services.runtime.metrics import BadMessage

DEFAULT_INPUT_RATE = 24000
PREROLL_S = 0.3  # of audio kept before detected speech, so that its first sound is not cut
END = object()

log = logging.getLogger(__name__)


@dataclass
class Turn:
    exchange: Exchange
    want_text: bool
    want_audio: bool
    task: asyncio.Task | None = None
    progress: Progress = field(default_factory=lambda: Progress(time.perf_counter()))  # what a stopped turn used
    token_ids: list[int] = field(default_factory=list)
    frames_sent: int = 0
    samples_sent: int = 0
    finished: omni_pb2.Finished | None = None
    stopped: bool = False  # what of it is still queued is dropped, not sent
    done: bool = False


class Session:
    def __init__(self, gateway):
        self.gw = gateway
        self.id = uuid.uuid4().hex
        self.settings = omni_pb2.SessionSettings()
        self.input = InputAudio(omni_pb2.PCM_ENCODING_S16LE, DEFAULT_INPUT_RATE)
        self.detector: TurnDetector | None = None
        self.pending: list[omni_pb2.Part] = []
        self.next_item = ""  # the id the speech being heard will take when committed
        self.buffer = bytearray()  # 16 kHz PCM16 of the user turn being built
        self.buffer_start = 0.0  # its place in the session's input audio, in seconds
        self.heard = 0.0  # seconds of input audio so far
        self.turn: Turn | None = None
        self.out = Outbox()
        cfg = gateway.cfg
        self.history = History(self.id, cfg.gateway.session_context_tokens or gateway.max_context // 2,
                               cfg.limits.max_media_items, gateway.prompts.tokenizer, gateway.spec.n_window)
        self.max_buffer = int(cfg.limits.max_audio_seconds * RATE) * 2

    async def run(self, requests):
        """The session's events for the client, until the client ends its stream and the answer under way ends."""
        self._emit(session=self._info())
        reader = asyncio.create_task(self._read(requests))
        try:
            while (item := await self.out.get()) is not END:
                turn, resp = item
                if turn is not None and turn.stopped:
                    continue
                if turn is not None and resp.HasField("audio"):
                    a = resp.audio
                    turn.frames_sent += len(a.codec_codes) // max(1, a.num_codebooks)
                    turn.samples_sent += round(a.duration_seconds * SAMPLE_RATE)
                    if not self.settings.return_codec_codes:
                        del a.codec_codes[:]
                        a.num_codebooks = 0
                yield resp
        finally:
            reader.cancel()
            if self.turn is not None:
                self.turn.stopped = True
                self.turn.task.cancel()

    def _emit(self, turn_id: str = "", **event) -> None:
        self.out.put_last((None, omni_pb2.ConverseResponse(turn_id=turn_id, **event)))

    def _error(self, exc: BaseException, event: str = "", turn_id: str = "") -> None:
        if isinstance(exc, OmniError):
            code, message = exc.code.name, str(exc)
        elif isinstance(exc, grpc.aio.AioRpcError):  # a stage's refusal, in its own words
            code, message = exc.code().name, exc.details() or ""
        else:
            log.exception("session %s", self.id, exc_info=exc)
            code, message = "INTERNAL", f"internal error: {type(exc).__name__}: {exc}"
        self._emit(turn_id, error=omni_pb2.ConverseError(code=code, message=message, event=event))

    async def _read(self, requests) -> None:
        try:
            async for req in requests:
                if isinstance(req, BadMessage):
                    self._error(InvalidArgument(req.problem))
                    continue
                kind = req.WhichOneof("event")
                try:
                    if kind is None:
                        raise InvalidArgument("the event is empty: set one of settings, audio, item, commit, cancel, "
                                              "clear, delete_item, truncate_item")
                    await getattr(self, f"_on_{kind}")(getattr(req, kind))
                except OmniError as e:
                    self._error(e, kind)
            if self.turn is not None:  # the client has said all it will: its last answer still goes out
                await asyncio.wait([self.turn.task])
        finally:
            self.out.put_last(END)

    def _info(self) -> omni_pb2.SessionInfo:
        s = omni_pb2.SessionSettings()
        s.CopyFrom(self.settings)
        s.input_encoding = s.input_encoding or omni_pb2.PCM_ENCODING_S16LE
        s.input_sample_rate = s.input_sample_rate or DEFAULT_INPUT_RATE
        s.audio_format = s.audio_format or omni_pb2.AUDIO_FORMAT_PCM16
        if not s.output_modalities:
            s.output_modalities.append(omni_pb2.MODALITY_TEXT)
        if s.turn_detection.enabled:
            s.turn_detection.CopyFrom(self._detection(s.turn_detection))
        return omni_pb2.SessionInfo(session_id=self.id, settings=s)

    def _detection(self, t: omni_pb2.TurnDetection) -> omni_pb2.TurnDetection:
        """`t` with the detector's defaults where it leaves them unset."""
        return omni_pb2.TurnDetection(
            enabled=t.enabled, aggressiveness=t.aggressiveness if t.HasField("aggressiveness") else AGGRESSIVENESS,
            speech_ms=t.speech_ms if t.HasField("speech_ms") else SPEECH_MS,
            silence_ms=t.silence_ms if t.HasField("silence_ms") else SILENCE_MS)

    def _request(self, settings: omni_pb2.SessionSettings, messages) -> omni_pb2.GenerateRequest:
        """A turn's Generate request; text is always asked for, its token ids being the transcript's."""
        audio = omni_pb2.MODALITY_AUDIO in settings.output_modalities
        return omni_pb2.GenerateRequest(
            messages=messages, voice=settings.voice, sampling=settings.sampling, talker_sampling=settings.talker_sampling,
            audio_format=settings.audio_format, return_codec_codes=True,
            output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if audio else []),
        )

    async def _on_settings(self, s: omni_pb2.SessionSettings) -> None:
        info = omni_pb2.SessionSettings()
        info.CopyFrom(s)
        rate = s.input_sample_rate or DEFAULT_INPUT_RATE
        same_input = (s.input_encoding or 1, rate) == (self.settings.input_encoding or 1, self.settings.input_sample_rate or DEFAULT_INPUT_RATE)
        if self.buffer and not same_input:
            raise FailedPrecondition("the input format cannot change while input audio is buffered: commit or clear it first")
        audio = self.input if same_input else InputAudio(s.input_encoding, rate)
        detector = None
        if s.turn_detection == self.settings.turn_detection:  # mid-speech, a new detector would miss its end
            detector = self.detector
        elif s.turn_detection.enabled:
            t = self._detection(s.turn_detection)
            detector = TurnDetector(t.aggressiveness, t.speech_ms, t.silence_ms)
        if s.instructions:
            self.gw.prompts.check_text(s.instructions, "instructions")
        # What Generate would refuse of these settings (voice, modalities, sampling), refused now
        probe = [omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=[omni_pb2.Part(text="-")])]
        resolve(self._request(s, probe), self.gw.spec, self.gw.cfg.limits, self.gw.talkers is not None, self.gw.prompts.check_text)
        self.settings, self.input, self.detector = info, audio, detector
        self._emit(session=self._info())

    async def _on_audio(self, data: bytes) -> None:
        pcm = self.input.push(data)
        if len(self.buffer) + len(pcm) > self.max_buffer:
            raise ResourceExhausted(f"the input audio buffer would hold over {self.max_buffer // 2 / RATE:.0f} s, the "
                                    "limit of one clip: commit or clear it")
        self.buffer += pcm
        self.heard += len(pcm) / 2 / RATE
        if self.detector is None:
            return
        for what, at in self.detector.push(pcm):
            if what == "started":
                self.next_item = self.next_item or self.history.new_item_id()
                self._emit(speech_started=omni_pb2.SpeechStarted(audio_start_seconds=at, item_id=self.next_item))
                if self.turn is not None:
                    await self._stop(omni_pb2.TURN_STATUS_INTERRUPTED)
                self._trim(at - PREROLL_S)
            else:
                self._emit(speech_stopped=omni_pb2.SpeechStopped(audio_end_seconds=at, item_id=self.next_item))
                await self._on_commit(omni_pb2.Commit())
        if not self.detector.speaking:  # only what could become the start of speech is kept
            self._trim(self.heard - PREROLL_S - self.detector.start_window.maxlen * FRAME_MS / 1000)

    def _trim(self, start: float) -> None:
        cut = int(max(0.0, start - self.buffer_start) * RATE) * 2
        if cut > 0:
            del self.buffer[:cut]
            self.buffer_start += cut / 2 / RATE

    async def _on_item(self, m: omni_pb2.Message) -> None:
        if m.role not in (omni_pb2.ROLE_UNSPECIFIED, omni_pb2.ROLE_USER):
            raise InvalidArgument(f"item: role {omni_pb2.Role.Name(m.role)} is not the user's; instructions are in settings")
        if not m.parts:
            raise InvalidArgument("item: no parts")
        for j, part in enumerate(m.parts):
            kind = part.WhichOneof("content")
            if kind is None:
                raise InvalidArgument(f"item.parts[{j}]: empty part")
            if kind == "text":
                self.gw.prompts.check_text(part.text, f"item.parts[{j}]")
        self.pending.extend(m.parts)

    async def _on_commit(self, c: omni_pb2.Commit) -> None:
        if self.turn is not None:
            raise FailedPrecondition("commit: an answer is in progress; cancel it first")
        parts = list(self.pending)
        seconds = len(self.buffer) / 2 / RATE
        if self.buffer:
            parts.append(omni_pb2.Part(audio=omni_pb2.Audio(pcm=omni_pb2.RawPcm(
                data=bytes(self.buffer), sample_rate=RATE, encoding=omni_pb2.PCM_ENCODING_S16LE))))
        open_ = self.history.open
        if not parts and (c.hold or open_ is None):
            raise InvalidArgument("commit: nothing to commit, no input audio or items since the last commit")
        if parts and c.item_id and self.history.find(c.item_id) is not None:
            raise InvalidArgument(f"commit: item_id {c.item_id!r} is already in the conversation")
        if parts:
            item_id = c.item_id or self.next_item or self.history.new_item_id()
            open_ = self.history.add_user(parts, item_id)
            self.pending.clear()
            self.next_item = ""
            self.buffer_start += seconds
            self.buffer.clear()
            self._emit(open_.id, committed=omni_pb2.TurnCommitted(audio_seconds=seconds, parts=len(parts), item_id=item_id))
        if not c.hold:
            self._answer(open_)

    async def _on_cancel(self, c: omni_pb2.Cancel) -> None:
        if self.turn is None:
            raise FailedPrecondition("cancel: no answer is in progress")
        await self._stop(omni_pb2.TURN_STATUS_CANCELLED)

    async def _on_clear(self, c: omni_pb2.Clear) -> None:
        self.pending.clear()
        self.next_item = ""
        self.buffer_start += len(self.buffer) / 2 / RATE
        self.buffer.clear()
        if c.history:
            if self.turn is not None:
                await self._stop(omni_pb2.TURN_STATUS_CANCELLED)
            self.history.clear()
        self._emit(cleared=omni_pb2.InputCleared(history=c.history))

    def _item(self, item_id: str, event: str) -> Exchange:
        """The exchange holding `item_id`, which no answer in progress may depend on."""
        ex = self.history.find(item_id) if item_id else None
        if ex is None:
            raise NotFound(f"{event}: no item {item_id!r} in the conversation")
        if self.turn is not None and self.turn.exchange is ex:
            raise FailedPrecondition(f"{event}: item {item_id!r} belongs to the answer in progress; cancel it first")
        return ex

    async def _on_delete_item(self, d: omni_pb2.DeleteItem) -> None:
        self._item(d.item_id, "delete_item")
        self.history.delete(d.item_id)
        self._emit(item_deleted=omni_pb2.ItemDeleted(item_id=d.item_id))

    async def _on_truncate_item(self, t: omni_pb2.TruncateItem) -> None:
        ex = self._item(t.item_id, "truncate_item")
        if t.item_id != ex.answer_id:
            raise InvalidArgument(f"truncate_item: {t.item_id!r} is a user message; only an answer's audio is cut")
        duration = ex.audio_samples / SAMPLE_RATE
        if not ex.audio_samples or not 0.0 <= t.audio_end_seconds <= duration + 1e-3:  # a ms of the client's rounding
            raise InvalidArgument(f"truncate_item: audio_end_seconds {t.audio_end_seconds} is outside the answer's "
                                  f"{duration:.3f} s of audio")
        transcript = self.history.cut(ex, min(1.0, t.audio_end_seconds / duration), self.gw.spec.spoken_tokens)
        self._emit(item_truncated=omni_pb2.ItemTruncated(item_id=t.item_id, audio_end_seconds=t.audio_end_seconds,
                                                         transcript=transcript))

    def _answer(self, ex: Exchange) -> None:
        mods = self.settings.output_modalities
        turn = Turn(ex, want_text=not mods or omni_pb2.MODALITY_TEXT in mods, want_audio=omni_pb2.MODALITY_AUDIO in mods)
        self._truncate()  # the turn just committed may bring the media over a request's limit
        req = self._request(self.settings, self.history.messages(self.settings.instructions))
        req.request_id = ex.id
        self.turn = turn
        ex.answer_id = self.history.new_item_id()
        self._emit(ex.id, started=omni_pb2.TurnStarted(item_id=ex.answer_id))
        turn.task = asyncio.create_task(self._run_turn(turn, req))

    async def _run_turn(self, turn: Turn, req: omni_pb2.GenerateRequest) -> None:
        rid = turn.exchange.id
        try:
            async with aclosing(self.gw.generate(req, None, turn.progress)) as responses:
                async for r in responses:
                    kind = r.WhichOneof("event")
                    if kind == "text":
                        turn.token_ids += r.text.token_ids
                        if turn.want_text:
                            await self.out.put((turn, omni_pb2.ConverseResponse(turn_id=rid, text=r.text)))
                    elif kind == "audio":
                        await self.out.put((turn, omni_pb2.ConverseResponse(turn_id=rid, audio=r.audio)))
                    else:
                        turn.finished = r.finished
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a turn's failure is the session's event, not its end
            self._error(e, turn_id=rid)
            self._finish(turn, omni_pb2.TURN_STATUS_FAILED)
            return
        self._finish(turn, omni_pb2.TURN_STATUS_COMPLETED)

    async def _stop(self, status: int) -> None:
        """Stops the answer in progress at once: nothing more of it is sent, and every stage call it made ends."""
        turn = self.turn
        turn.stopped = True
        turn.task.cancel()
        await asyncio.wait([turn.task])
        self._finish(turn, status)

    def _finish(self, turn: Turn, status: int) -> None:
        if turn.done:
            return
        turn.done, self.turn = True, None
        ex = turn.exchange
        ids = turn.token_ids
        if turn.want_audio:
            ids = ids[:self.gw.spec.spoken_tokens(turn.frames_sent)]
        transcript = self.gw.prompts.tokenizer.decode(ids, skip_special_tokens=True)
        if turn.finished is not None:
            usage = turn.finished.usage
        else:  # the prompt it was given, the tokens made before the cut, the audio that reached the client
            usage = turn.progress.usage()
            usage.audio_frames, usage.audio_seconds = turn.frames_sent, turn.samples_sent / SAMPLE_RATE
        if status == omni_pb2.TURN_STATUS_FAILED:
            self.history.forget(ex)
        else:  # a turn stopped before its prompt was laid out has its tokens estimated
            self.history.answered(ex, transcript.strip(), ids, usage.prompt_tokens or None, turn.frames_sent,
                                  turn.samples_sent)
        reason = turn.finished.reason if turn.finished is not None else omni_pb2.FINISH_REASON_UNSPECIFIED
        self._emit(ex.id, done=omni_pb2.TurnDone(status=status, reason=reason, usage=usage, transcript=ex.answer))
        self._truncate()

    def _truncate(self) -> None:
        if (truncated := self.history.truncate()) is not None:
            self._emit(truncated=truncated)
