"""The native thinker engine: our model on a paged KV cache, continuous batching with chunked prefill,
one forward per step over every scheduled sequence. Same requests and outputs as the reference engine. Its decode
steps replay CUDA graphs (services/thinker/decode.py) and, with `overlap`, go ahead of their tokens
(services/thinker/overlap.py)."""

import random
import time
from dataclasses import dataclass, replace

import torch

from services.llm.attention import SeqSlice, TorchAttention, pick_backend
from services.llm.context import step_context
from services.llm.fp8 import fp8_layout, quantize_experts_
from services.llm.host import Laps, upload, wait
from services.llm.kv_cache import BlockAllocator, KVCache
from services.llm.layers import fuse, fuse_projections_
from services.llm.moe import capturable
from services.llm import pieces
from services.llm.sampling import CANDIDATES, sample_batch, tensor_drawable
from services.llm.scheduler import Scheduler, SeqState, Work
from services.model.load import _default_dtype, load_config, load_weights_
from services.model.spec import OmniSpec
from services.runtime.errors import ResourceExhausted
from services.thinker.decode import DecodeGraphs
from services.thinker.model import ThinkerModel
from services.thinker.overlap import OverlappedDecode
from services.thinker.reference import ThinkerSeq, ThinkerStep, accept, validate


@dataclass(eq=False)
class ThinkerState(SeqState):
    states_sent: int = 0  # positions whose states went out (a recomputed sequence does not send them twice)


class NativeThinker(OverlappedDecode):
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32, load_format: str = "auto",
                 seed: int = 0, block_size: int = 16, kv_blocks: int = 0, max_batched_tokens: int = 2048,
                 max_seqs: int = 256, moe: str = "loop", fp8_experts: str = "off", fp8_activations: bool = False,
                 fp8_fused_quant: bool = False,
                 attention: str = "auto", cuda_graph_max_batch: int = 0, compile: bool = False, overlap: bool = False,
                 graph_sampling: bool = True, host_states: bool = False, step_graphs: int = 0, decode_tensor_cores: bool = True,
                 decode_split_kv_max_batch: int = -1, decode_direct_plan: bool = False, decode_keep_plans: bool = False,
                 decode_mapped_io: bool = False, decode_hashed_noise: bool = False, decode_graph_copies: int = 1,
                 spin_wait: bool = False, triton_linear: bool = False):
        self.device, self.dtype = torch.device(device), dtype
        self.spin_wait = spin_wait  # waits on the device's steps poll, not sleep (services.llm.host.wait)
        self.graph_sampling = graph_sampling  # captured steps' tokens drawn in the graph where tensor_drawable
        self.host_states = host_states  # overlapped steps' speech states copied to the host with their tokens
        self.overlap, self.pending = overlap, None  # the launched decode step whose tokens are not read yet
        self._launched, self._launch_turn = [None, None], 0  # launched steps' token buffers and their copies' events (_launch_buffers)
        self.overlapped = 0  # steps launched before the previous one's tokens were read
        # The host's time by phase of its steps (schedule, inputs, plan, launch, queue, finish, rest; and its waits on
        # the device), summed.
        self.laps = Laps()
        self.decode_tensor_cores = decode_tensor_cores  # captured decode attention on flashinfer's tensor-core kernels
        self.decode_split_kv_max_batch = decode_split_kv_max_batch  # graphs of more sequences attend without splitting keys
        self.decode_direct_plan = decode_direct_plan  # decode graphs' attention planned past flashinfer's wrapper
        self.decode_keep_plans = decode_keep_plans  # and not replanned where the schedule would not change (KeptPlan)
        self.decode_mapped_io = decode_mapped_io  # decode graphs load their inputs and store their draws themselves
        self.decode_hashed_noise = decode_hashed_noise  # and draw for unseeded requests from hashed noise, no generator
        if compile:
            fuse()
        config = load_config(model_dir)
        with torch.device(self.device), _default_dtype(dtype):
            self.model = ThinkerModel(config.thinker_config)
        load_weights_(self.model, "thinker", model_dir, dtype, load_format, seed)
        if fp8_experts != "off":
            quantize_experts_(self.model, *fp8_layout(fp8_experts, model_dir, load_format, "thinker"),
                              activations=fp8_activations, fused_quant=fp8_fused_quant)
        self.model.to(self.device).eval().requires_grad_(False)  # no autograd records, no compiled variants for it
        fuse_projections_(self.model)
        spec = OmniSpec.load(model_dir)
        tc = config.thinker_config.text_config
        self.accept_layer = spec.talker["accept_hidden_layer"] if spec.has_talker else None
        self.vocab, self.hidden_size = tc.vocab_size, tc.hidden_size
        self.moe = moe
        self.triton_linear = triton_linear  # steps of up to 64 rows project attention's output in Triton (triton_linear)
        self.attention_backend = pick_backend(attention, self.device, dtype)
        workspace = None
        if self.attention_backend == "flashinfer":
            from services.llm.flashinfer_attention import WORKSPACE_BYTES
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        blocks = kv_blocks or self._fitting_blocks(tc, block_size)
        # One block more than the allocator hands out: padding rows of captured steps write there.
        self.cache = KVCache.allocate(tc.num_hidden_layers, blocks + 1, block_size, tc.num_key_value_heads, tc.head_dim, dtype, self.device)
        self.scheduler = Scheduler(BlockAllocator(blocks), block_size, max_batched_tokens, max_seqs)
        scale, heads = tc.head_dim ** -0.5, tc.num_attention_heads
        if self.attention_backend == "flashinfer":
            from services.llm.flashinfer_attention import FlashInferAttention
            self.attention = FlashInferAttention(self.cache, scale, heads, workspace)
        else:
            self.attention = TorchAttention(self.cache, scale)
        self.states: dict[int, SeqState] = {}
        self.decode: DecodeGraphs | None = None  # decode steps as CUDA graphs (services/thinker/decode.py)
        if cuda_graph_max_batch and self.attention_backend == "flashinfer" and capturable(moe, fp8_experts):
            self.decode = DecodeGraphs(self, min(cuda_graph_max_batch, max_seqs), blocks, scale, heads, workspace,
                                       decode_mapped_io, decode_graph_copies)
        # Other steps' layers between attentions as graphs (step_graphs); eager pieces on the CPU.
        self.pieces = pieces.build(self.model.model, self.cache, step_graphs, max_batched_tokens, moe, blocks * block_size,
                                   self.attention_backend == "flashinfer" and capturable(moe, fp8_experts), triton_linear)

    def _fitting_blocks(self, tc, block_size: int) -> int:
        per_block = KVCache.bytes_per_block(tc.num_hidden_layers, block_size, tc.num_key_value_heads, tc.head_dim, self.dtype)
        if self.device.type != "cuda":
            return max(64, (1 << 30) // per_block)  # 1 GiB on the CPU
        free, _ = torch.cuda.mem_get_info(self.device)
        # What the weights left, minus room for activations, graphs and sampling: an allocator that runs out
        # frees its cache and retries on every step, which costs more than the blocks are worth.
        blocks = int(min(free * 0.8, free - (8 << 30))) // per_block - 1
        if blocks < 1:
            raise MemoryError(f"{free / 2**30:.1f} GiB free on {self.device} after the weights: no room for a KV cache "
                              "(set thinker.kv_blocks to size it by hand)")
        return blocks

    @property
    def summary(self) -> str:
        graphs = f"decode graphs up to {self.decode.max_batch}" if self.decode is not None else "no graphs"
        if self.pieces is not None:
            graphs += f", steps of up to {self.pieces.max_tokens} tokens in {'graphs' if self.pieces.graphs else 'pieces'}"
        return (f"native (attention {self.attention_backend}, experts {self.moe}, {graphs}, "
                f"{self.scheduler.allocator.num_blocks} KV blocks of {self.scheduler.block_size})")

    @property
    def capacity(self) -> int:
        return self.scheduler.allocator.num_blocks * self.scheduler.block_size

    # -- engine protocol ---------------------------------------------------------------------------

    def add(self, seq: ThinkerSeq) -> None:
        validate(seq, self.vocab, self.hidden_size, self.accept_layer is not None)
        need = len(seq.prompt_ids) + seq.params.max_tokens
        if need > self.capacity:
            raise ResourceExhausted(f"prompt + max_tokens = {need} tokens is more than the KV cache holds ({self.capacity})")
        if self.decode_hashed_noise and seq.params.temperature > 0 and not seq.params.seed:
            # A seed of its own, random: every draw of it from hashed noise, in the graphs and out
            seq.params = replace(seq.params, seed=random.getrandbits(63) | 1)
        state = ThinkerState(tokens=seq.prompt_ids.tolist(), owner=seq)
        self.states[id(seq)] = state
        self.scheduler.add(state)

    def ready(self, seq: ThinkerSeq) -> bool:
        return not seq.done

    def free(self, seq: ThinkerSeq) -> None:
        state = self.states.pop(id(seq), None)
        if state is not None:
            self.scheduler.remove(state)

    @torch.no_grad()
    def step(self, seqs: list[ThinkerSeq]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """One forward over what the scheduler picks from every request added (not only `seqs`). With
        `overlap`, a decode step is launched first and the previous step's tokens are read after: what this
        returns is the previous step's (and nothing, the first time)."""
        t0 = time.perf_counter()
        self.laps.start()
        self.last_wait_s = 0.0
        launched_s = self.decode.graphs.launch_s if self.decode is not None else 0.0
        work = self.scheduler.schedule()
        self.laps.lap("schedule")
        if not work and self.pending is None:
            return []
        out = []
        if work and self.overlap and self._overlappable(work):
            launched = self._launch(work)
            if self.pending is not None:
                out = self._finish(self.pending)
            self.pending = launched
        else:
            if self.pending is not None:  # its tokens are this step's inputs: read them first
                out = self._finish(self.pending)
                self.pending = None
                work = [w for w in work if not w.seq.owner.done]  # ended on the token just read: nothing to compute
            if work:
                out += self._step(work)
        self.laps.lap("rest")
        elapsed = time.perf_counter() - t0
        self.last_host_s = elapsed - self.last_wait_s  # the step's own work on the CPU, the device's wait excluded
        # Of which launching its graph (a wait inside the driver would show here, not in last_wait_s).
        self.last_launch_s = (self.decode.graphs.launch_s if self.decode is not None else 0.0) - launched_s
        for w in work:
            seq = w.seq.owner
            if not seq.started:  # a request's wait for its first step ended at this one's start
                seq.started = t0
            if w.start < seq.prompt_len:
                seq.prefill_seconds += elapsed
            else:
                seq.decode_seconds += elapsed
        return out

    def _step(self, work: list[Work]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        if self._graphable(work):
            return self._graph_step(work)
        if self.decode is not None:
            self.decode.forget()
        embeds, positions, ds_rows, ds_values = self._inputs(work)
        capture = self.accept_layer if any(w.seq.owner.return_states for w in work) else None
        attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, w.n) for w in work])
        if self.pieces is not None and embeds.shape[0] <= self.pieces.max_tokens:
            hidden, captured = self.pieces.forward(embeds, positions, attention, ds_rows, ds_values, capture)
        else:
            with step_context(attention, self.moe, self.triton_linear):
                hidden, captured = self.model(embeds, positions, ds_rows, ds_values, capture)
        self.scheduler.advance(work)
        return self._outputs(work, embeds, captured, lambda rows: self.model.lm_head(hidden[upload(rows, self.device, torch.long)]))

    # -- one step ----------------------------------------------------------------------------------

    def _graphable(self, work: list[Work]) -> bool:
        """Every sequence decodes the one token it generated last (no prompt rows, which may carry media)."""
        return (self.decode is not None and len(work) <= self.decode.max_batch
                and all(w.n == 1 and w.start >= w.seq.owner.prompt_len and w.start + 1 == len(w.seq.tokens) for w in work))

    def _graph_step(self, work: list[Work]):
        counters = [len(w.seq.owner.generated) for w in work]
        embeds, captured, logits, drawn = self.decode.replay(work, [w.seq.tokens[w.start] for w in work], counters,
                                                             self.laps)
        self.scheduler.advance(work)
        if captured is not None and any(w.seq.owner.return_states for w in work):  # the next replay overwrites them
            embeds, captured = embeds.clone(), captured.clone()
        # Every row ends (rows == 0..n-1): the graph's draws are the step's tokens where every row allows them.
        return self._outputs(work, embeds, captured, lambda rows: logits, self._drawn(work, drawn, counters))

    def _drawn(self, work: list[Work], drawn: torch.Tensor, counters: list[int]) -> torch.Tensor | None:
        """The tokens a captured step drew, if they stand for every row's (graph_sampling, tensor_drawable)."""
        if self.graph_sampling and all(tensor_drawable(w.seq.owner.params, c, CANDIDATES) for w, c in zip(work, counters)):
            return drawn
        return None

    def _inputs(self, work: list[Work]):
        """Input embeddings [N, H] (multimodal rows from their spans), positions [3, N], DeepStack rows and values."""
        embeds, positions, ds_rows, ds_values, row = [], [], [], [], 0
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            idx = torch.arange(w.start, w.start + w.n)
            e = self.model.model.embed_tokens(upload(w.seq.tokens[w.start:w.start + w.n], self.device, torch.long))
            for span in seq.spans:
                lo, hi = max(w.start, span.offset), min(w.start + w.n, span.offset + len(span.embeds))
                if lo >= hi:
                    continue
                e[lo - w.start:hi - w.start] = span.embeds[lo - span.offset:hi - span.offset].to(self.device, self.dtype)
                if span.deepstack:
                    ds_rows.append(torch.arange(row + lo - w.start, row + hi - w.start))
                    ds_values.append([d[lo - span.offset:hi - span.offset] for d in span.deepstack])
            prompt_len = len(seq.prompt_ids)
            pos = (idx + seq.rope_delta).float().expand(3, -1).clone()
            in_prompt = idx < prompt_len
            if seq.positions is not None and in_prompt.any():
                pos[:, in_prompt] = seq.positions[:, idx[in_prompt]]
            elif in_prompt.any():
                pos[:, in_prompt] = idx[in_prompt].float()
            embeds.append(e)
            positions.append(pos)
            row += w.n
        deepstack = None
        if ds_rows:
            deepstack = [torch.cat(level).to(self.device, self.dtype) for level in zip(*ds_values)]
            ds_rows = upload(torch.cat(ds_rows), self.device)
        # Host values through pinned memory (upload): from pageable memory each copy would first wait for the
        # device to finish what this step queued before it.
        return torch.cat(embeds), upload(torch.cat(positions, dim=1), self.device), ds_rows if deepstack else None, deepstack

    def _outputs(self, work: list[Work], embeds, captured, logits_of, drawn=None) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """Each request's step output; its token drawn from the rows that end (`drawn`: already drawn for them, in
        row order, by a captured step)."""
        ends, row = [], 0
        for w in work:
            row += w.n
            if w.start + w.n == len(w.seq.tokens):  # caught up with its tokens: choose the next one
                ends.append((w, row - 1))
        sampled = {}
        if ends:
            logits = logits_of([r for _, r in ends])
            owners = [w.seq.owner for w, _ in ends]
            seen = [w.seq.tokens if s.params.repetition_penalty != 1.0 else None
                    for (w, _), s in zip(ends, owners)]
            generated = [len(s.generated) for s in owners]
            chosen = drawn if drawn is not None else sample_batch(logits, [s.params for s in owners], seen, generated,
                                                                  counters=generated)
            self.laps.lap("queue")
            t_wait, c_wait = time.perf_counter(), time.thread_time()
            if self.spin_wait and chosen.is_cuda:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                wait(done, True)
            tokens = chosen.tolist()  # the step's one wait on the device
            self.last_wait_s = time.perf_counter() - t_wait
            self.laps.waited(self.last_wait_s, time.thread_time() - c_wait)
            sampled = {id(w): t for (w, _), t in zip(ends, tokens)}
        out, row = [], 0
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            step = ThinkerStep([])
            if seq.return_states and w.start + w.n > w.seq.states_sent:  # rows a preempted sequence recomputes are sent once
                skip = max(0, w.seq.states_sent - w.start)
                step.state_start = w.start + skip
                step.embeds, step.hidden = embeds[row + skip:row + w.n], captured[row + skip:row + w.n]
                w.seq.states_sent = w.start + w.n
            if seq.embed_token_ids and not seq.generated and w.start == 0:
                step.token_embeds = self.model.model.embed_tokens(upload(seq.embed_token_ids, self.device, torch.long))
            if id(w) in sampled:
                w.seq.tokens.append(sampled[id(w)])
                accept(seq, step, sampled[id(w)])
            row += w.n
            if step.token_ids or step.embeds is not None or step.token_embeds is not None:
                out.append((seq, step))
        out = self._mark_ready(out)
        self.laps.lap("finish")
        return out

    def _mark_ready(self, out: list[tuple[ThinkerSeq, ThinkerStep]]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """One event after the step's output tensors, for the steps that carry any (see ThinkerStep.ready)."""
        carrying = [step for _, step in out if step.embeds is not None or step.token_embeds is not None]
        if carrying and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for step in carrying:
                step.ready = ready
        return out

