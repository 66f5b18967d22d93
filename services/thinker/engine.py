"""The native thinker engine: the engine core with the thinker's inputs (token and multimodal embeddings,
M-RoPE positions, DeepStack), its decode graphs, and its outputs (tokens, and the talker's states for speech)."""

import time
from dataclasses import dataclass

import torch

from services.llm.attention import SeqSlice
from services.llm.engine import Engine, load_model
from services.llm.host import upload
from services.llm.sampling import CANDIDATES, sample_batch, tensor_drawable
from services.llm.scheduler import SeqState, Work
from services.model.load import DTYPES
from services.model.spec import OmniSpec
from services.runtime.config import ModelConfig, ThinkerConfig
from services.runtime.errors import RequestFailed, ResourceExhausted
from services.thinker.decode import TokenGraphs
from services.thinker.model import ThinkerModel
from services.thinker.seq import ThinkerSeq, ThinkerStep, accept, validate

PLACEHOLDER = -1  # a token drawn by a launched step, not read yet


@dataclass(eq=False)
class ThinkerState(SeqState):
    states_sent: int = 0  # so a recomputed sequence does not send states twice


@dataclass
class Launched:
    """A launched step: its rows, tokens drawn for the rows in `ends` (None: all), and what goes out with them."""
    work: list
    ends: list[int] | None
    tokens: torch.Tensor
    host: torch.Tensor | None  # pinned memory the tokens land in, read after `event`
    event: object
    placeholders: list[bool] | None = None  # launched ahead: the rows given a placeholder token
    row_of: dict | None = None  # SeqState -> row, where a next step's input is
    states: list | None = None  # per row: (first position, embeds [n, H], states [n, H]) or None
    ready: object = None  # an event after `states` and `token_embeds`
    token_embeds: dict | None = None  # row -> the request's embed_token_ids embedded
    carried: bool = False  # `tokens` are the graphs' own draws in `carry`
    fence: tuple | None = None  # (Staging, event): the staging buffer is free once `event` is waited for


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to pinned memory when the queue reaches this (read after a later event)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class NativeThinker(Engine):
    def __init__(self, model: ModelConfig, cfg: ThinkerConfig, device: str = "cpu"):
        device = torch.device(device)
        self.model = load_model(lambda c: ThinkerModel(c.thinker_config), "thinker", model, device, cfg.fp8)
        super().__init__(self.model.model, self.model.text_config, cfg, device, DTYPES[model.dtype], cfg.fp8)
        spec = OmniSpec.load(model.dir)
        self.accept_layer = spec.talker["accept_hidden_layer"] if spec.has_talker else None
        self.vocab, self.hidden_size = self.text_config.vocab_size, self.text_config.hidden_size
        self.states: dict[int, ThinkerState] = {}
        self._launched, self._launch_turn = [None, None], 0  # pinned token buffers and events, in turn
        self.decode = TokenGraphs(self, self.decode_batch) if self.decode_batch else None

    @property
    def summary(self) -> str:
        return super().summary(f", decode graphs up to {self.decode.max_batch}" if self.decode is not None else "")

    def add(self, seq: ThinkerSeq) -> None:
        validate(seq, self.vocab, self.hidden_size, self.accept_layer is not None)
        need = len(seq.prompt_ids) + seq.params.max_tokens
        if need > self.capacity:
            raise ResourceExhausted(f"prompt + max_tokens = {need} tokens is more than the KV cache holds ({self.capacity})")
        state = ThinkerState(tokens=seq.prompt_ids.tolist(), owner=seq)
        self.states[id(seq)] = state
        self.scheduler.add(state)

    def ready(self, seq: ThinkerSeq) -> bool:
        return not seq.done

    def free(self, seq: ThinkerSeq) -> None:
        state = self.states.pop(id(seq), None)
        if state is not None:
            self.scheduler.remove(state)

    def account(self, work: list[Work], started: float, seconds: float) -> None:
        for w in work:
            seq = w.seq.owner
            if not seq.started:
                seq.started = started
            if w.start < seq.prompt_len:
                seq.prefill_seconds += seconds
            else:
                seq.decode_seconds += seconds

    def runs_ahead(self, work: list[Work]) -> bool:
        """Every row decodes its last token and its sampling does not depend on the pending token."""
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            p = seq.params
            if (w.n != 1 or w.start < seq.prompt_len or w.start + 1 != len(w.seq.tokens)
                    or p.repetition_penalty != 1.0 or (p.min_tokens and p.stop_token_ids)):
                return False
        return True

    def launch(self, work: list[Work], ahead: bool) -> Launched:
        decoding = all(w.n == 1 and w.start >= w.seq.owner.prompt_len and w.start + 1 == len(w.seq.tokens) for w in work)
        if decoding:
            return self._launch_decode(work, self.pending if ahead else None, ahead)
        if self.decode is not None:
            self.decode.forget()
        return self._launch_prompt(work)

    # -- decode steps: one row per sequence, its last token ------------------------------------------

    def _launch_decode(self, work: list[Work], prev: Launched | None, ahead: bool) -> Launched:
        """A decode step whose inputs may still be on the device (`prev`'s); ahead, each row gets a placeholder."""
        n = len(work)
        pending_rows = prev.row_of if prev is not None else {}
        # Comprehensions, not a loop of appends: this runs for every row of every decode step
        seq_states = [w.seq for w in work]
        owners = [s.owner for s in seq_states]
        src = [pending_rows.get(s, -1) for s in seq_states]  # the pending step's row, or -1: on the host
        in_order = prev is not None and src == list(range(n))
        counters = [len(o.generated) + (r >= 0) for o, r in zip(owners, src)]
        send = ([o.return_states and w.start + 1 > w.seq.states_sent for o, w in zip(owners, work)]
                if any(o.return_states for o in owners) else [False] * n)
        sending = any(send)
        drawable = all([tensor_drawable(o.params, c, CANDIDATES) for o, c in zip(owners, counters)])
        host = event = None
        if self.decode is not None and n <= self.decode.max_batch:
            if prev is not None and not prev.carried and max(src) >= 0:  # the graph reads the pending tokens in `carry`
                self.decode.carry[:len(prev.tokens)].copy_(prev.tokens)
            ids = 0 if in_order else [w.seq.tokens[w.start] if r < 0 else 0 for w, r in zip(work, src)]
            embeds, captured, logits, drawn = self.decode.replay(work, ids, counters, self.laps, src)
            if drawable:  # the graph wrote its draws to the host
                tokens, host, event = drawn, self.decode.last_drawn_host, self.decode.last_done
        else:
            ids = upload([w.seq.tokens[w.start] if r < 0 else 0 for w, r in zip(work, src)], self.device, torch.long)
            if prev is not None and max(src) >= 0:
                at = upload(src, self.device, torch.long)
                ids = torch.where(at >= 0, prev.tokens[at.clamp_min(0)], ids)
            if self.decode is not None:
                self.decode.forget()
            positions = upload([w.start + w.seq.owner.rope_delta for w in work], self.device, torch.float32).expand(3, -1)
            attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, 1) for w in work])
            embeds = self.model.model.embed_tokens(ids)
            hidden, captured = self._forward(embeds, positions, attention, self.accept_layer if sending else None)
            logits = self.model.lm_head(hidden)
            drawable = False
        self.scheduler.advance(work)
        if not drawable:
            seen = [w.seq.tokens if o.params.repetition_penalty != 1.0 else None for o, w in zip(owners, work)]
            tokens = sample_batch(logits, [o.params for o in owners], seen, [len(o.generated) for o in owners],
                                  counters=counters)
        carried = host is not None
        fence = (self.decode.last_staging, event) if carried else None
        states = None
        if sending:  # the next replay overwrites them: copied out beside the tokens
            states = [(w.start, row) if sent else None for row, (w, sent) in enumerate(zip(work, send))]
            copies = _pinned_copy(embeds) if embeds.is_cuda else embeds.clone(), \
                _pinned_copy(captured) if captured.is_cuda else captured.clone()
            states = [None if s is None else (s[0], copies[0][s[1]:s[1] + 1], copies[1][s[1]:s[1] + 1]) for s in states]
            for w, sent in zip(work, send):
                if sent:
                    w.seq.states_sent = w.start + 1
        if not tokens.is_cuda:
            host = tokens
        elif host is None or states is not None:
            if host is None:
                host, event = self._token_buffer(n)
                host.copy_(tokens, non_blocking=True)
            if states is not None:  # an event after the states' copies too
                event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        placeholders = None
        if ahead:
            placeholders = [c + 1 < o.params.max_tokens for o, c in zip(owners, counters)]
            for state, placeholder in zip(seq_states, placeholders):
                if placeholder:
                    state.tokens.append(PLACEHOLDER)
        self.laps.lap("queue")
        return Launched(work, None, tokens, host, event, placeholders, dict(zip(seq_states, range(n))), states,
                        carried=carried, fence=fence)

    def _forward(self, embeds, positions, attention, capture: int | None, ds_rows=None, deepstack=None):
        """The normed output of a step outside the decode graphs, and layer `capture`'s output."""
        kept = {}

        def run():
            out, kept["states"] = self.model(embeds, positions, ds_rows, deepstack, capture)
            return out

        hidden = self.forward(embeds, positions, attention, run, self.model.after_layer(capture, ds_rows, deepstack, kept))
        return hidden, hidden if capture == len(self.model.model.layers) else kept.get("states")

    def _token_buffer(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer for `n` tokens and its copy's event, two in turn: a step is read before the next but one."""
        self._launch_turn ^= 1
        if self._launched[self._launch_turn] is None or len(self._launched[self._launch_turn][0]) < n:
            self._launched[self._launch_turn] = (torch.empty(max(n, 256), dtype=torch.long, pin_memory=True),
                                                 torch.cuda.Event())
        host, copied = self._launched[self._launch_turn]
        return host[:n], copied

    # -- prompt steps: chunks of prompts, beside decode rows -----------------------------------------

    def _launch_prompt(self, work: list[Work]) -> Launched:
        embeds, positions, ds_rows, ds_values = self._inputs(work)
        capture = self.accept_layer if any(w.seq.owner.return_states for w in work) else None
        attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, w.n) for w in work])
        hidden, captured = self._forward(embeds, positions, attention, capture, ds_rows, ds_values)
        self.scheduler.advance(work)
        ends, last, row = [], [], 0
        for i, w in enumerate(work):
            row += w.n
            if w.start + w.n == len(w.seq.tokens):  # caught up: draw the next token
                ends.append(i)
                last.append(row - 1)
        tokens = None
        if ends:
            owners = [work[i].seq.owner for i in ends]
            seen = [work[i].seq.tokens if s.params.repetition_penalty != 1.0 else None for i, s in zip(ends, owners)]
            generated = [len(s.generated) for s in owners]
            logits = self.model.lm_head(hidden[upload(last, self.device, torch.long)])
            tokens = sample_batch(logits, [s.params for s in owners], seen, generated, counters=generated)
        states, token_embeds, row = [], {}, 0
        for i, w in enumerate(work):
            seq: ThinkerSeq = w.seq.owner
            state = None
            if seq.return_states and w.start + w.n > w.seq.states_sent:  # recomputed rows are sent once
                skip = max(0, w.seq.states_sent - w.start)
                state = (w.start + skip, embeds[row + skip:row + w.n], captured[row + skip:row + w.n])
                w.seq.states_sent = w.start + w.n
            states.append(state)
            if seq.embed_token_ids and not seq.generated and w.start == 0:
                token_embeds[i] = self.model.model.embed_tokens(upload(seq.embed_token_ids, self.device, torch.long))
            row += w.n
        ready = None
        if self.device.type == "cuda" and (token_embeds or any(s is not None for s in states)):
            ready = torch.cuda.Event()  # after the step's output tensors (ThinkerStep.ready)
            ready.record(torch.cuda.current_stream(self.device))
        self.laps.lap("queue")
        return Launched(work, ends, tokens, None, None, states=states, ready=ready, token_embeds=token_embeds)

    def _inputs(self, work: list[Work]):
        """Input embeddings [N, H], positions [3, N], DeepStack rows and values."""
        embeds, positions, ds_rows, ds_values, row = [], [], [], [], 0
        for w in work:
            try:
                e, pos = self._seq_inputs(w, row, ds_rows, ds_values)
            except Exception as exc:  # noqa: BLE001 - this request's own inputs: it fails alone
                raise RequestFailed(w.seq.owner, exc) from exc
            embeds.append(e)
            positions.append(pos)
            row += w.n
        deepstack = None
        if ds_rows:
            deepstack = [torch.cat(level).to(self.device, self.dtype) for level in zip(*ds_values)]
            ds_rows = upload(torch.cat(ds_rows), self.device)
        return torch.cat(embeds), upload(torch.cat(positions, dim=1), self.device), ds_rows if deepstack else None, deepstack

    def _seq_inputs(self, w: Work, row: int, ds_rows: list, ds_values: list):
        """One row's input embeddings [n, H] and positions [3, n]; its DeepStack rows and values appended."""
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
        pos = (idx + seq.rope_delta).float().expand(3, -1).clone()
        in_prompt = idx < seq.prompt_len
        if seq.positions is not None and in_prompt.any():
            pos[:, in_prompt] = seq.positions[:, idx[in_prompt]]
        elif in_prompt.any():
            pos[:, in_prompt] = idx[in_prompt].float()
        return e, pos

    # -- reading a step back -------------------------------------------------------------------------

    def finish(self, p: Launched) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """The step's tokens read, placeholders filled -> each live request's output."""
        t_wait, c_wait = time.perf_counter(), time.thread_time()
        if p.event is not None:
            p.event.synchronize()
            if p.fence is not None:  # the next fill of that staging buffer need not ask the driver
                p.fence[0].reached(p.fence[1])
        tokens = (p.host if p.host is not None else p.tokens).tolist() if p.tokens is not None else []
        self.laps.waited(time.perf_counter() - t_wait, time.thread_time() - c_wait)
        out = self._decoded(p, tokens) if p.ends is None else self._prompted(p, tokens)
        self.laps.lap("finish")
        return out

    def _decoded(self, p: Launched, tokens: list[int]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        out, live = [], self.states
        for row, (w, token) in enumerate(zip(p.work, tokens)):
            state = w.seq
            seq: ThinkerSeq = state.owner
            if live.get(id(seq)) is not state or seq.done:
                continue
            if p.placeholders is not None and p.placeholders[row]:
                state.tokens[w.start + 1] = token
            else:
                state.tokens.append(token)
            step = ThinkerStep([])
            if p.states is not None and p.states[row] is not None:
                step.state_start, step.embeds, step.hidden = p.states[row]  # on the host, complete after `event`
            out.append((seq, accept(seq, step, token)))
        return out

    def _prompted(self, p: Launched, tokens: list[int]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        sampled = dict(zip(p.ends, tokens))
        out = []
        for i, w in enumerate(p.work):
            seq: ThinkerSeq = w.seq.owner
            if self.states.get(id(seq)) is not w.seq:
                continue
            step = ThinkerStep([])
            if p.states[i] is not None:
                step.state_start, step.embeds, step.hidden = p.states[i]
            step.token_embeds = p.token_embeds.get(i)
            if i in sampled:
                w.seq.tokens.append(sampled[i])
                accept(seq, step, sampled[i])
            if step.token_ids or step.embeds is not None or step.token_embeds is not None:
                step.ready = p.ready if (step.embeds is not None or step.token_embeds is not None) else None
                out.append((seq, step))
        return out
