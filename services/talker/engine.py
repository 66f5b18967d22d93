"""The native talker engine: the engine core with the talker's inputs (prompts from the thinker's states, each
frame's code embeddings and text), its frame graphs, and its outputs.

A step runs one talker forward over every request, draws the first codes on the device and runs the code
predictor for the whole batch straight after; its codes are read once the next step is launched (overlap)."""

import itertools
import time
from dataclasses import dataclass, field

import torch

from services.llm.attention import SeqSlice
from services.llm.engine import Engine, load_model
from services.llm.graphs import ladder
from services.llm.host import mark, scalar, seconds_between, upload
from services.llm.sampling import CANDIDATES, sample_batch
from services.llm.scheduler import SeqState, Work
from services.model.load import DTYPES
from services.runtime.config import ModelConfig, TalkerConfig
from services.runtime.errors import ResourceExhausted
from services.talker.decode import FrameGraphs
from services.talker.model import TalkerModel
from services.talker.predictor import PredictorFrames
from services.talker.seq import TalkerSeq, TalkerStep
from services.talker.speech import SpeechEngine

PLACEHOLDER = -1  # a first code not read back: the host never needs its value


@dataclass(eq=False)
class TalkerState(SeqState):
    """Every input the talker took for the request, so a preempted request can be recomputed."""
    # Per forward: rows [n, D] and positions [3, n], or for a frame (step inputs [B, D], row) and (positions, column):
    # an index into the step's tensors rather than a slice made every step
    inputs: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    prompt_len: int = 0  # rows before the first frame's (their three M-RoPE rows may differ)
    slot: int = 0  # the request's row of `seen`
    drawn: int = 0  # rows after which a frame was drawn: a recompute reaching them draws none

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, positions = _rows(self.inputs[-1]), _columns(self.positions[-1])
        base = len(self.tokens) - len(inputs)
        if start < base:  # a recompute reaching into older inputs: join them once
            inputs = torch.cat([_rows(x) for x in self.inputs])
            positions = torch.cat([_columns(p) for p in self.positions], dim=1)
            self.inputs, self.positions, base = [inputs], [positions], 0
        return inputs[start - base:start - base + n], positions[:, start - base:start - base + n]


def _rows(x) -> torch.Tensor:
    return x[0][x[1]:x[1] + 1] if isinstance(x, tuple) else x


def _columns(p) -> torch.Tensor:
    return p[0][:, p[1]:p[1] + 1] if isinstance(p, tuple) else p


@dataclass(eq=False)
class LaunchedFrames:
    """A launched frame step: its requests, their codes [B, G] (pinned, on a GPU), marks (talker, predictor, end)."""
    seqs: list
    codes: torch.Tensor
    marks: tuple


class NativeTalker(Engine, SpeechEngine):
    KV_SHARE, KV_HEADROOM, KV_CPU_BYTES = 0.5, 0, 256 << 20  # the rest is code2wav's and the activations'

    def __init__(self, model: ModelConfig, cfg: TalkerConfig, device: str = "cpu"):
        device, dtype = torch.device(device), DTYPES[model.dtype]
        talker = load_model(lambda c: TalkerModel(c.talker_config), "talker", model, device)
        text, cp = talker.config.text_config, talker.config.code_predictor_config
        Engine.__init__(self, talker.model, text, cfg, device, dtype)
        SpeechEngine.__init__(self, talker, model, cfg.chunks, device, dtype, native_code2wav=True)
        self.predictor = PredictorFrames(talker, cp, text.hidden_size, self.groups, cfg.max_seqs, dtype, device, self.moe,
                                         self.laps)
        self.states: dict[int, TalkerState] = {}
        # Codes drawn as a device mask: no host history, so a step samples before the last is read; last row: padding
        self.seen = torch.zeros(max(cfg.max_seqs, 1) + 1, talker.codec_head.out_features, dtype=torch.bool, device=device)
        self.free_slots = list(range(len(self.seen) - 1))[::-1]
        self.drawn_mark = scalar(True, self.seen)  # on the device: a Python True would block (host.scalar)
        self.graph_draws = 0
        # The step's stacked frame inputs and id(state) -> row, so a captured step takes the tensor as it is
        self.queued: tuple[torch.Tensor, dict[int, int]] | None = None
        self.admitted: dict[int, TalkerSeq] = {}
        self.decode: FrameGraphs | None = None
        if device.type == "cuda" and cfg.cuda_graph_max_batch:  # the predictor and code2wav are dense: no experts
            max_batch = min(cfg.cuda_graph_max_batch, cfg.max_seqs)
            self.predictor.capture(ladder(max_batch))
            if self.graphable:
                self.decode = FrameGraphs(self, max_batch)
            self.capture_code2wav(max_batch)
        if device.type == "cuda":  # code2wav beside the frame loop
            self.vocode_stream = torch.cuda.Stream(device)

    @property
    def summary(self) -> str:
        return Engine.summary(self, f", frame graphs up to {self.decode.max_batch}" if self.decode is not None else "")

    # -- requests ------------------------------------------------------------------------------------

    def add(self, seq: TalkerSeq) -> None:
        need = len(seq.prompt_ids) + 9 + seq.params.max_tokens  # the prompt, the assistant prefix, a row a frame
        if need > self.capacity:
            raise ResourceExhausted(f"{seq.params.max_tokens} frames after a prompt of {len(seq.prompt_ids)} tokens is "
                                    f"more than the talker's KV cache holds ({self.capacity} positions)")
        SpeechEngine.add(self, seq)

    def started(self, seq: TalkerSeq) -> bool:
        return id(seq) in self.states

    def runnable(self, seq: TalkerSeq) -> bool:
        return (self.states[id(seq)].pending > 0 or (seq.next_embed is not None and self._input_known(seq))
                or seq.frames_unread > 0)  # a step reads it

    def _input_known(self, seq: TalkerSeq) -> bool:
        # The input after frame t adds the text of thinker position L + 1 + t (or tts_eos / tts_pad after it)
        return seq.text_done or seq.n_states > len(seq.prompt_ids) + len(seq.frames) + seq.frames_unread

    def free(self, seq: TalkerSeq) -> None:
        SpeechEngine.free(self, seq)
        state = self.states.pop(id(seq), None)
        if state is not None:
            self.scheduler.remove(state)
            self.free_slots.append(state.slot)

    # -- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, seqs: list[TalkerSeq]) -> list[tuple[TalkerSeq, TalkerStep]]:
        touched = {id(s): s for s in Engine.step(self, seqs)}
        touched.update(self.admitted)
        audio = self.vocode(list(touched.values()), wait=not touched)  # only audio left: wait rather than poll
        for seq, _ in audio.values():
            touched.setdefault(id(seq), seq)
        self.laps.lap("vocode")
        # Only audio or the end: anything else would wake the server's event loop for nothing
        return [(seq, TalkerStep(audio[id(seq)][1] if id(seq) in audio else [], finished=seq.done))
                for seq in touched.values() if id(seq) in audio or seq.done]

    def schedule(self, seqs: list[TalkerSeq]) -> list[Work]:
        """Admits new requests, queues every caught-up request's next input, then schedules."""
        self.admitted = {}
        for seq in seqs:
            if not self.started(seq):
                self.admitted[id(seq)] = seq
                self._admit(seq)
        going = [s for s in seqs if self.started(s) and s.next_embed is not None and self._input_known(s)]
        self.laps.lap("admit")
        self.queued = None
        if going:
            self._queue_inputs(going)
        self.laps.lap("inputs")
        return self.scheduler.schedule()

    def runs_ahead(self, work: list[Work]) -> bool:
        return True  # a frame's next input (its code embeddings) stays on the device

    def _admit(self, seq: TalkerSeq) -> None:
        if seq.n_states < len(seq.prompt_ids) + 1:  # the thinker ended before its first text token
            seq.done = True
            return
        inputs, positions = self.prompt_inputs(seq)
        if not self.free_slots:  # more requests started than max_seqs
            n = len(self.seen)
            self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
            self.free_slots = list(range(2 * n - 1, n - 1, -1))
        state = TalkerState(tokens=[self.tts_pad_id] * len(inputs), owner=seq, inputs=[inputs], positions=[positions],
                            prompt_len=len(inputs), slot=self.free_slots.pop())
        self.seen[state.slot] = False
        self.states[id(seq)] = state
        seq.mark("admitted")
        self.scheduler.add(state)

    def _queue_inputs(self, seqs: list[TalkerSeq]) -> None:
        """Each request's next input (last frame's code embeddings plus text) and positions, all at once."""
        states = [self.states[id(s)] for s in seqs]
        frames = [(s, len(s.frames) + s.frames_unread - 1) for s in seqs]  # the frame each input follows
        inputs = torch.stack([s.next_embed for s in seqs]) + self.trailing_rows(frames)
        positions = upload([len(st.tokens) + s.rope_delta for s, st in zip(seqs, states)], self.device,
                           torch.float32)[None].expand(3, -1)
        for j, (seq, state) in enumerate(zip(seqs, states)):
            state.inputs.append((inputs, j))
            state.positions.append((positions, j))
            state.tokens.append(PLACEHOLDER)
            seq.next_embed = None
        self.queued = inputs, {id(state): j for j, state in enumerate(states)}

    def launch(self, work: list[Work], ahead: bool) -> LaunchedFrames | None:
        """One talker forward over `work`; requests that caught up get their next frame launched, not read."""
        started, t0 = time.perf_counter(), mark(self.device)
        caught_up = [i for i, w in enumerate(work) if w.start + w.n == len(w.seq.tokens) > w.seq.drawn]
        drawn = None
        if self._graphable(work):
            h, logits, drawn = self._graph_rows(work)
            if len(caught_up) < len(work):
                rows = upload(caught_up, self.device, torch.long)
                h, logits, drawn = h[rows], logits[rows], None
        else:
            if self.decode is not None:
                self.decode.forget()
            hidden = self._rows(work)
            last = list(itertools.accumulate(w.n for w in work))
            h = hidden[upload([last[i] - 1 for i in caught_up], self.device, torch.long)] if caught_up else None
            logits = self.talker.codec_head(h) if caught_up else None
        self.scheduler.advance(work)
        for i in caught_up:
            work[i].seq.drawn = len(work[i].seq.tokens)
        if caught_up:
            seqs = [work[i].seq.owner for i in caught_up]
            if drawn is not None:  # drawn in the graph: only marking them seen is left
                code0, slots = drawn
                self.seen[slots, code0] = self.drawn_mark
                self.graph_draws += 1
            else:
                code0 = self._sample_first(seqs, logits)
            self.laps.lap("sample")
            return self._launch_frames(seqs, code0, h, t0)
        share = (time.perf_counter() - started) / len(work)  # prompt rows: nothing read back, so host time
        for w in work:
            w.seq.owner.seconds["talker"] += share
        return None

    def _rows(self, work: list[Work]) -> torch.Tensor:
        """The talker's hidden states for every row of a step outside the frame graphs."""
        rows = [w.seq.rows(w.start, w.n) for w in work]
        decode = all(w.n == 1 and w.start + 1 == len(w.seq.tokens) for w in work)
        x = self._step_inputs(work) if decode else torch.cat([r[0] for r in rows])
        positions = torch.cat([r[1] for r in rows], dim=1)
        attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, w.n) for w in work])
        return self.forward(x, positions, attention, lambda: self.talker.model(x, positions))

    def _graphable(self, work: list[Work]) -> bool:
        """Every request takes its one pending frame input (prompt rows' positions may differ by axis)."""
        return (self.decode is not None and len(work) <= self.decode.max_batch
                and all(w.n == 1 and w.start >= w.seq.prompt_len and w.start + 1 == len(w.seq.tokens) for w in work))

    def _graph_rows(self, work: list[Work]) -> tuple:
        """(states, codec logits, first codes and `seen` slots or None) from the graph, valid until the next replay."""
        seqs = [w.seq.owner for w in work]
        draw = [(s, self.states[id(s)].slot) for s in seqs] if self._first_drawable(seqs) else None
        return self.decode.replay(work, self._step_inputs(work), draw, self.laps)

    def _step_inputs(self, work: list[Work]) -> torch.Tensor:
        """The inputs [n, D] of a step's rows: the queued stack as it is where possible."""
        inputs, row_of = self.queued or (None, {})
        rows = [row_of.get(id(w.seq), -1) for w in work]
        if -1 in rows:
            return torch.cat([w.seq.rows(w.start, 1)[0] for w in work])
        if rows == list(range(len(inputs))):
            return inputs
        return inputs[upload(rows, self.device, torch.long)]

    # -- frames --------------------------------------------------------------------------------------

    def _sample_first(self, seqs: list[TalkerSeq], logits: torch.Tensor) -> torch.Tensor:
        """First codes [B] drawn on the device, the repetition penalty from `seen`; each drawn code marked seen."""
        slots = upload([self.states[id(s)].slot for s in seqs], self.device, torch.long)
        pens = [s.params.repetition_penalty for s in seqs]
        if any(p != 1.0 for p in pens):
            pen = upload(pens, self.device, torch.float32)[:, None]
            logits = logits.float()
            logits = torch.where(self.seen[slots], torch.where(logits < 0, logits * pen, logits / pen), logits)
        frames = [len(s.frames) + s.frames_unread for s in seqs]
        code0 = sample_batch(logits, [s.params for s in seqs], None, frames, [self.suppressed(s) for s in seqs],
                             counters=frames)
        self.seen[slots, code0] = self.drawn_mark
        return code0

    def _first_drawable(self, seqs: list[TalkerSeq]) -> bool:
        """Whether the graph's draw gives every row `_sample_first`'s code, and `seen` is still the graphs' tensor."""
        return self.seen is self.decode.seen and all(
            (s.params.temperature == 0 or 0 < s.params.top_k < CANDIDATES)
            and not (len(s.frames) + s.frames_unread < s.params.min_tokens and s.params.stop_token_ids) for s in seqs)

    def _launch_frames(self, seqs: list[TalkerSeq], code0: torch.Tensor, hidden: torch.Tensor, since) -> LaunchedFrames:
        """The code predictor queued for `code0` [B] and `hidden` [B, D]; each request keeps its next input."""
        launched = mark(self.device)
        codes, embeds = self.predictor.run(seqs, code0, hidden)
        sums = embeds.sum(1)
        host = codes
        if codes.is_cuda:  # the next replay overwrites them
            host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
            host.copy_(codes, non_blocking=True)
        finished = mark(self.device)
        for seq, summed in zip(seqs, sums):
            seq.frames_unread += 1
            if len(seq.frames) + seq.frames_unread < seq.params.max_tokens:
                seq.next_embed = summed
        self.laps.lap("queue")
        return LaunchedFrames(seqs, host, (since, launched, finished))

    def finish(self, frames: LaunchedFrames) -> list[TalkerSeq]:
        """Reads a frame step's codes (its one wait) and keeps each live request's frame, or its end -> those read."""
        since, launched, finished = frames.marks
        self.wait(finished)
        rows = frames.codes.tolist()
        n = len(frames.seqs)
        talker, predictor = seconds_between(since, launched) / n, seconds_between(launched, finished) / n
        read = []
        for seq, row in zip(frames.seqs, rows):
            seq.frames_unread -= 1
            if seq.done or self.states.get(id(seq)) is None:
                continue
            read.append(seq)
            seq.seconds["talker"] += talker
            seq.seconds["code_predictor"] += predictor
            if row[0] == self.codec_eos:
                seq.done, seq.eos, seq.next_embed = True, True, None
                continue
            seq.frames.append(row)
            seq.mark("first_frame")
            if len(seq.frames) >= seq.params.max_tokens:
                seq.done = True
        self.laps.lap("read")
        return read
