"""The native talker engine: many speech requests batched. Each step runs one talker forward over every
scheduled request on a paged KV cache (prefills in chunks, one row per decode), samples every first code
at once on the device, and runs the code predictor for all those frames straight after (its 15 steps once
for the whole batch); one read of the device takes the step's codes. With `overlap`, that read comes after
the next step is launched, so the host's work for a step runs while the device computes the one before.
Same requests and outputs as the reference engine. A step's frames, drawn, launched and read back, are
services/talker/frames.py's (FrameSteps)."""

import itertools
import time
from dataclasses import dataclass, field

import torch

from services.llm import pieces
from services.llm.attention import SeqSlice, TorchAttention, pick_backend
from services.llm.fp8 import fp8_layout, quantize_experts_
from services.llm.host import mark, scalar, upload
from services.llm.context import step_context
from services.llm.kv_cache import BlockAllocator, KVCache
from services.llm.layers import fuse, fuse_projections_
from services.llm.moe import capturable
from services.llm.scheduler import Scheduler, SeqState
from services.model.load import _default_dtype, load_config, load_weights_
from services.runtime.errors import ResourceExhausted
from services.talker.model import TalkerModel
from services.talker.decode import FrameGraphs
from services.talker.frames import FrameSteps, LaunchedFrames
from services.talker.predictor import PredictorFrames
from services.talker.seq import TalkerSeq, TalkerStep
from services.talker.speech import SpeechEngine

PLACEHOLDER = -1  # a talker token (first code) not read back from the device: its value is never needed there


@dataclass(eq=False)
class TalkerState(SeqState):
    """Every input the talker took for the request, so a preempted request can be recomputed."""
    # Per forward: its rows [n, D] and positions [3, n] (the prompt's), or (a step's inputs [B, D], row) and (its
    # positions [3, B], column) for a frame's one row: kept as the step's tensors and an index, not sliced out
    # every step for every request (64 views a step at 32 requests), and taken out only where read.
    inputs: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    prompt_len: int = 0  # rows before the first frame's (their positions may differ across the three M-RoPE rows)
    slot: int = 0  # the request's row of the engine's `seen` codes
    drawn: int = 0  # rows after which a frame was drawn: a recompute (after preemption) reaching them draws none

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, positions = _rows(self.inputs[-1]), _columns(self.positions[-1])
        base = len(self.tokens) - len(inputs)
        if start < base:  # a chunk reaching into older inputs (a recompute): join them once
            inputs = torch.cat([_rows(x) for x in self.inputs])
            positions = torch.cat([_columns(p) for p in self.positions], dim=1)
            self.inputs, self.positions, base = [inputs], [positions], 0
        return inputs[start - base:start - base + n], positions[:, start - base:start - base + n]


def _rows(x) -> torch.Tensor:
    return x[0][x[1]:x[1] + 1] if isinstance(x, tuple) else x


def _columns(p) -> torch.Tensor:
    return p[0][:, p[1]:p[1] + 1] if isinstance(p, tuple) else p


class NativeTalker(FrameSteps, SpeechEngine):
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32, load_format: str = "auto",
                 seed: int = 0, first_chunk_frames: int = 5, chunk_frames: int = 25, left_context_frames: int = 25,
                 block_size: int = 16, kv_blocks: int = 0, max_batched_tokens: int = 2048, max_seqs: int = 256, moe: str = "loop",
                 fp8_experts: str = "off", fp8_activations: bool = False, fp8_fused_quant: bool = False,
                 attention: str = "auto", cuda_graph_max_batch: int = 0,
                 compile: bool = False, code2wav_graphs: bool = True, code2wav_stream: bool = True, overlap: bool = False,
                 code2wav_dtype: torch.dtype | None = None, chunk_growth: float = 0.0, graph_sampling: bool = False,
                 step_graphs: int = 0, decode_tensor_cores: bool = True, decode_split_kv_max_batch: int = -1,
                 decode_direct_plan: bool = False, decode_keep_plans: bool = False, spin_wait: bool = False,
                 code2wav_fuse: bool = False, code2wav_native: bool = False, frames_first: bool = False):
        self.decode_tensor_cores = decode_tensor_cores  # captured decode attention on flashinfer's tensor-core kernels
        self.decode_split_kv_max_batch = decode_split_kv_max_batch  # graphs of more sequences attend without splitting keys
        self.decode_direct_plan = decode_direct_plan  # decode graphs' attention planned past flashinfer's wrapper
        self.decode_keep_plans = decode_keep_plans  # and not replanned where the schedule would not change (KeptPlan)
        if compile:
            fuse()
        config = load_config(model_dir)
        with torch.device(device), _default_dtype(dtype):
            talker = TalkerModel(config.talker_config)
        load_weights_(talker, "talker", model_dir, dtype, load_format, seed)
        if fp8_experts != "off":
            quantize_experts_(talker, *fp8_layout(fp8_experts, model_dir, load_format, "talker"),
                              activations=fp8_activations, fused_quant=fp8_fused_quant)
        talker.to(device).eval().requires_grad_(False)  # no autograd records, no compiled variants for it
        fuse_projections_(talker)
        super().__init__(talker, model_dir, device, dtype, load_format, seed,
                         (first_chunk_frames, chunk_frames, left_context_frames, chunk_growth), code2wav_dtype, code2wav_fuse,
                         code2wav_native)
        self.spin_wait = spin_wait  # its waits on the device poll, not sleep (SpeechEngine.wait)
        text, cp = config.talker_config.text_config, config.talker_config.code_predictor_config
        blocks = kv_blocks or self._fitting_blocks(text, block_size)
        # One block more than the allocator hands out: padding rows of captured steps write there.
        self.cache = KVCache.allocate(text.num_hidden_layers, blocks + 1, block_size, text.num_key_value_heads, text.head_dim, dtype, self.device)
        self.scheduler = Scheduler(BlockAllocator(blocks), block_size, max_batched_tokens, max_seqs)
        self.attention_backend = pick_backend(attention, self.device, dtype)
        if self.attention_backend == "flashinfer":
            from services.llm.flashinfer_attention import FlashInferAttention
            self.attention = FlashInferAttention(self.cache, text.head_dim ** -0.5, text.num_attention_heads)
            self.workspace = self.attention.workspace
        else:
            self.attention = TorchAttention(self.cache, text.head_dim ** -0.5)
        self.moe = moe
        # The code predictor's frame: one frame's 15 steps as fixed shapes (or one graph) for the whole batch.
        self.predictor = PredictorFrames(self.talker, cp, text.hidden_size, self.groups, max_seqs, dtype, self.device,
                                         moe, self.laps)
        self.states: dict[int, TalkerState] = {}
        # First codes each request has drawn, as a mask on the device: the repetition penalty needs no history from
        # the host, so a step can be sampled before the one before it is read.
        # Its last row is no request's: a captured step's padding rows read it.
        self.seen = torch.zeros(max(max_seqs, 1) + 1, self.talker.codec_head.out_features, dtype=torch.bool, device=self.device)
        self.free_slots = list(range(len(self.seen) - 1))[::-1]
        # What marks a code drawn, on the device: `True` assigned through the codes as an index would be copied
        # from host memory first, waiting for the step the device is running (1.8 ms a frame step at 32 requests,
        # bench/results/profile-1xh200-talker-b32-f29cb53.txt, and no overlap).
        self.drawn_mark = scalar(True, self.seen)
        # First codes drawn inside the captured steps where _first_drawable (the draw is captured only with it on).
        self.graph_sampling = self.draws_captured = graph_sampling
        self.graph_draws = 0  # frame steps whose first codes were drawn in their graph
        self.overlap, self.pending = overlap, None  # the launched frame step whose codes are not read yet
        self.overlapped = 0  # frame steps launched before the previous one's codes were read
        # This step's frame inputs as _queue_inputs stacked them, and the row of each request's (by id of its
        # state): a captured step taking them takes that tensor, not each request's row joined again.
        self.queued: tuple[torch.Tensor, dict[int, int]] | None = None
        self.decode = None  # the frame steps as CUDA graphs (FrameGraphs)
        if cuda_graph_max_batch and self.device.type == "cuda":  # the predictor is dense: no experts to capture
            from services.llm.graphs import ladder
            sizes = ladder(min(cuda_graph_max_batch, max_seqs))
            self.predictor.capture(sizes)
            if self.attention_backend == "flashinfer" and capturable(moe, fp8_experts):
                self.decode = FrameGraphs(self, sizes, blocks, text, self.draws_captured)
            if code2wav_graphs:
                self.capture_code2wav(min(cuda_graph_max_batch, max_seqs))
        # Prompt and mixed steps' layers between attentions as graphs (step_graphs); eager pieces on the CPU.
        self.pieces = pieces.build(self.talker.model, self.cache, step_graphs, max_batched_tokens, moe, blocks * block_size,
                                   self.attention_backend == "flashinfer" and capturable(moe, fp8_experts))
        if code2wav_stream and self.device.type == "cuda":
            self.vocode_stream = torch.cuda.Stream(self.device)
        # talker.frames_first: the frame loop on a stream of high priority, code2wav's of the default, low: the
        # device's block scheduler gives SMs the frame loop's small kernels want to them first, and code2wav's
        # large ones the rest (launched into a stream, a graph's kernels take the stream's priority).
        self.frame_stream = None
        if frames_first and self.device.type == "cuda":
            self.frame_stream = torch.cuda.Stream(self.device, priority=-1)  # torch's high priority (default 0: low)

    @property
    def summary(self) -> str:
        in_pieces = f", steps of up to {self.pieces.max_tokens} tokens in pieces" if self.pieces is not None else ""
        return (f"native (attention {self.attention_backend}, experts {self.moe}{in_pieces}, "
                f"{self.scheduler.allocator.num_blocks} KV blocks of {self.scheduler.block_size})")

    def _fitting_blocks(self, text, block_size: int) -> int:
        per_block = KVCache.bytes_per_block(text.num_hidden_layers, block_size, text.num_key_value_heads, text.head_dim, self.dtype)
        if self.device.type != "cuda":
            return max(64, (256 << 20) // per_block)
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * 0.5) // per_block  # the rest is code2wav's and the activations'

    # -- engine protocol ---------------------------------------------------------------------------

    def add(self, seq: TalkerSeq) -> None:
        need = len(seq.prompt_ids) + 9 + seq.params.max_tokens  # at most: the prompt, the assistant prefix, a row per frame
        capacity = self.scheduler.allocator.num_blocks * self.scheduler.block_size
        if need > capacity:
            raise ResourceExhausted(f"{seq.params.max_tokens} frames after a prompt of {len(seq.prompt_ids)} tokens is "
                                    f"more than the talker's KV cache holds ({capacity} positions)")
        super().add(seq)

    def started(self, seq: TalkerSeq) -> bool:
        return id(seq) in self.states

    def runnable(self, seq: TalkerSeq) -> bool:
        return (self.states[id(seq)].pending > 0 or (seq.next_embed is not None and self._input_known(seq))
                or seq.frames_unread > 0)  # a step reads it

    def _input_known(self, seq: TalkerSeq) -> bool:
        # The input after frame t adds the text of thinker position L + 1 + t (or tts_eos / tts_pad after it).
        return seq.text_done or seq.n_states > len(seq.prompt_ids) + len(seq.frames) + seq.frames_unread

    def free(self, seq: TalkerSeq) -> None:
        super().free(seq)
        state = self.states.pop(id(seq), None)
        if state is not None:
            self.scheduler.remove(state)
            self.free_slots.append(state.slot)

    @torch.no_grad()
    def step(self, seqs: list[TalkerSeq]) -> list[tuple[TalkerSeq, TalkerStep]]:
        if self.frame_stream is None:
            return self._step(seqs)
        # On the frame stream, ordered after everything queued on the current stream before (admitted prompts'
        # uploads) and before everything queued on it after (so memory freed there is reused only after this).
        current = torch.cuda.current_stream(self.device)
        self.frame_stream.wait_stream(current)
        with torch.cuda.stream(self.frame_stream):
            out = self._step(seqs)
        current.wait_stream(self.frame_stream)
        return out

    def _step(self, seqs: list[TalkerSeq]) -> list[tuple[TalkerSeq, TalkerStep]]:
        touched, laps = {}, self.laps
        laps.start()
        for seq in seqs:
            if not self.started(seq):
                touched[id(seq)] = seq
                self._admit(seq)
        going = [s for s in seqs if self.started(s) and s.next_embed is not None and self._input_known(s)]
        laps.lap("admit")
        self.queued = None
        if going:
            self._queue_inputs(going)
        laps.lap("inputs")
        launched = self._forward()
        if self.pending is not None:  # the frames launched last step (overlap): read now that this one is queued
            touched.update((id(s), s) for s in self._read(self.pending))
            self.pending = None
        if launched is not None and self.overlap:
            self.pending = launched
            self.overlapped += 1
        elif launched is not None:
            touched.update((id(s), s) for s in self._read(launched))
        laps.lap("read")
        # With nothing else queued (requests only waiting for their audio), wait for audio instead of polling.
        audio = self.vocode(list(touched.values()), wait=not touched)
        for seq, _ in audio.values():
            touched.setdefault(id(seq), seq)
        laps.lap("vocode")
        # Only what a caller sees: audio, or the end. A step without either posts nothing to the request's RPC (at
        # 64 requests, a hundred steps a second would otherwise wake the server's event loop 6,400 times a second
        # for nothing, each wake-up taking the interpreter lock from this thread).
        return [(seq, TalkerStep(audio[id(seq)][1] if id(seq) in audio else [], finished=seq.done))
                for seq in touched.values() if id(seq) in audio or seq.done]

    # -- one step ----------------------------------------------------------------------------------

    def _admit(self, seq: TalkerSeq) -> None:
        if seq.n_states < len(seq.prompt_ids) + 1:  # the thinker ended before its first text token
            seq.done = True
            return
        inputs, positions = self.prompt_inputs(seq)
        if not self.free_slots:  # more requests started than max_seqs: room for as many again
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
        """The talker's next input for each request: its last frame's code embeddings and the text that frame
        adds, with their positions, built for all of them at once (a few launches whatever the batch)."""
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

    def _forward(self) -> "LaunchedFrames | None":
        """One talker forward over what the scheduler picks; requests that caught up get their next frame
        launched (first code, then the code predictor), not read."""
        work = self.scheduler.schedule()
        self.laps.lap("schedule")
        if not work:
            return None
        started, t0 = time.perf_counter(), mark(self.device)
        # Rows that reach a request's last input and draw its next frame; not a recompute of rows drawn from before.
        caught_up = [i for i, w in enumerate(work) if w.start + w.n == len(w.seq.tokens) > w.seq.drawn]
        drawn = None
        # Rows picked through pinned memory (an index from a host list is copied from pageable memory, which
        # may wait for the frame step still running).
        if self._graphable(work):
            h, logits, drawn = self._graph_rows(work)
            if len(caught_up) < len(work):
                rows = upload(caught_up, self.device, torch.long)
                h, logits, drawn = h[rows], logits[rows], None
        else:
            if self.decode is not None:  # a step outside the graphs: the next replay's plan is rebuilt
                self.decode.forget()
            hidden = self._rows(work)
            last = list(itertools.accumulate(w.n for w in work))
            h = hidden[upload([last[i] - 1 for i in caught_up], self.device, torch.long)] if caught_up else None
            logits = self.talker.codec_head(h) if caught_up else None
        self.scheduler.advance(work)
        for i in caught_up:
            work[i].seq.drawn = len(work[i].seq.tokens)
        if caught_up:  # their first codes, sampled on the device, and their frames straight after
            seqs = [work[i].seq.owner for i in caught_up]
            if drawn is not None:  # drawn in the graph: only marking them seen is left
                code0, slots = drawn
                self.seen[slots, code0] = self.drawn_mark
                self.graph_draws += 1
            else:
                code0 = self._sample_first(seqs, logits)
            self.laps.lap("sample")
            return self._launch_frames(seqs, code0, h, t0)
        share = (time.perf_counter() - started) / len(work)  # prompt rows only: nothing is read back, the host's time
        for w in work:
            w.seq.owner.seconds["talker"] += share
        return None

    def _rows(self, work: list) -> torch.Tensor:
        """The talker's hidden states for every row of the step: in pieces (step_graphs), or eagerly."""
        rows = [w.seq.rows(w.start, w.n) for w in work]
        decode = all(w.n == 1 and w.start + 1 == len(w.seq.tokens) for w in work)  # each request's last input
        x = self._step_inputs(work) if decode else torch.cat([r[0] for r in rows])
        positions = torch.cat([r[1] for r in rows], dim=1)
        attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, w.n) for w in work])
        if self.pieces is not None and x.shape[0] <= self.pieces.max_tokens:
            return self.pieces.forward(x, positions, attention)[0]
        with step_context(attention, self.moe):
            return self.talker.model(x, positions)

    def _graphable(self, work: list) -> bool:
        """Every request takes its one pending frame input (no prompt rows, whose positions may differ by axis)."""
        return (self.decode is not None and len(work) <= self.decode.max_batch
                and all(w.n == 1 and w.start >= w.seq.prompt_len and w.start + 1 == len(w.seq.tokens) for w in work))

    def _graph_rows(self, work: list) -> tuple:
        """Hidden states and codec logits of a decode step, replayed from its graph (and the first codes drawn in
        it, where they stand for every row's, with the rows' slots in `seen` on the device): valid until the next
        replay (the predictor copies the states before it)."""
        seqs = [w.seq.owner for w in work]
        draw = [(s, self.states[id(s)].slot) for s in seqs] if self._first_drawable(seqs) else None
        return self.decode.replay(work, self._step_inputs(work), draw, self.laps)

    def _step_inputs(self, work: list) -> torch.Tensor:
        """The inputs [n, D] of a captured step's rows (each its request's last input): this step's queued ones
        as stacked, in their order or gathered into the work's; each request's row joined where one is older."""
        inputs, row_of = self.queued or (None, {})
        rows = [row_of.get(id(w.seq), -1) for w in work]
        if -1 in rows:
            return torch.cat([w.seq.rows(w.start, 1)[0] for w in work])
        if rows == list(range(len(inputs))):
            return inputs
        return inputs[upload(rows, self.device, torch.long)]
