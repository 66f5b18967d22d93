"""Overlapped decode for the native thinker (thinker.overlap): a decode step is launched before the previous step's
tokens are read, so the host's work for a step runs while the device computes the one before. `OverlappedDecode`
holds the engine's part of it (NativeThinker inherits it): whether a step's rows may go ahead of their tokens, a
step launched (from a decode graph, or eagerly) with its draws on their way to the host, and a launched step's
tokens read once the next one is launched."""

import time
from dataclasses import dataclass

import torch

from services.llm.attention import SeqSlice
from services.llm.context import step_context
from services.llm.host import upload, wait
from services.llm.sampling import CANDIDATES, sample_batch, tensor_drawable
from services.llm.scheduler import Work
from services.thinker.reference import ThinkerSeq, ThinkerStep, accept


PLACEHOLDER = -1  # a sequence's token drawn by a launched step, not read yet (overlap)


@dataclass
class _Pending:
    """A launched decode step: its rows, its tokens on the device and on their way to the host."""
    work: list
    tokens: torch.Tensor
    host: torch.Tensor
    event: object
    placeholders: list[bool]
    row_of: dict  # SeqState (hashed by identity) -> row
    send: list[bool]  # rows whose states go out with their token
    states: tuple | None  # (input embeddings, accept-layer states) of the step's rows, when any row sends them
    carried: bool = False  # its tokens are the decode graphs' `carry` (mapped_io)
    fence: tuple | None = None  # (Staging, event) where carried: `event` is passed once `event` above is waited for


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in pinned host memory, copied once the queue reaches this (read after a later event)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class OverlappedDecode:
    """NativeThinker's overlapped decode steps (its attributes: decode, scheduler, states, laps, ...)."""

    def _overlappable(self, work: list[Work]) -> bool:
        """Every row decodes its sequence's last token (real, or the pending step's), and its sampling needs
        nothing the pending token would change: no repetition penalty, no minimum length."""
        for w in work:
            seq: ThinkerSeq = w.seq.owner
            p = seq.params
            if (w.n != 1 or w.start < seq.prompt_len or w.start + 1 != len(w.seq.tokens)
                    or p.repetition_penalty != 1.0 or (p.min_tokens and p.stop_token_ids)):
                return False
        return True

    def _launch(self, work: list[Work]) -> "_Pending":
        """Queues a decode step whose input tokens may still be on the device (the pending step's), and its
        sampling; takes no token back to the host. Each row's sequence gets a placeholder token for what it
        draws, unless that token ends it by length (it is then not scheduled again)."""
        n = len(work)
        prev = self.pending
        pending_rows = prev.row_of if prev is not None else {}
        # The rows' values in comprehensions, not a loop of appends (this runs for every row of every decode step):
        # where each one's input token is (the pending step's row, or -1: on the host), its draw counter (the pending
        # token counts), whether its states go out with its token (speech requests, once per position), and whether
        # the step's draws stand for its token (tensor_drawable).
        seq_states = [w.seq for w in work]
        owners = [s.owner for s in seq_states]
        src = [pending_rows.get(s, -1) for s in seq_states]
        in_order = prev is not None and src == list(range(n))
        counters = [len(o.generated) + (r >= 0) for o, r in zip(owners, src)]
        send = ([o.return_states and w.start + 1 > w.seq.states_sent for o, w in zip(owners, work)]
                if any(o.return_states for o in owners) else [False] * n)
        row_of = dict(zip(seq_states, range(n)))
        drawable = self.graph_sampling and all([tensor_drawable(o.params, c, CANDIDATES) for o, c in zip(owners, counters)])
        graph = self.decode is not None and n <= self.decode.max_batch  # its rows all decode their last token
        mapped = graph and self.decode.mapped_io
        if mapped:  # the pending step's tokens taken from `carry` in the graph (copied there unless its draws)
            if prev is not None and not prev.carried and max(src) >= 0:
                self.decode.carry[:len(prev.tokens)].copy_(prev.tokens)
            ids = 0 if in_order else [w.seq.tokens[w.start] if r < 0 else 0 for w, r in zip(work, src)]
        elif in_order:  # every row's input is the pending step's token, in its order
            ids = prev.tokens[:n]
        else:
            ids = upload([w.seq.tokens[w.start] if r < 0 else 0 for w, r in zip(work, src)], self.device, torch.long)
            if any(r >= 0 for r in src):
                at = upload(src, self.device, torch.long)
                ids = torch.where(at >= 0, prev.tokens[at.clamp_min(0)], ids)
        # Speech requests get the row's states (input embedding, accept layer) with its token, once per position.
        states, drawn, sending, host, event = None, None, any(send), None, None
        if graph:
            embeds, captured, logits, drawn = self.decode.replay(work, ids, counters, self.laps, src if mapped else None)
            drawn = drawn if drawable else None  # the replay's outputs are the step's rows already
            if mapped and drawable:  # the graph wrote its draws to the host: read after its event
                host, event = self.decode.last_drawn_host, self.decode.last_done
            if sending:  # the next replay overwrites them: copied out (to the host below, or here)
                states = embeds, captured
                if not (self.host_states and embeds.is_cuda):
                    states = tuple(t.clone() for t in states)
        else:
            if self.decode is not None:
                self.decode.forget()
            positions = upload([w.start + w.seq.owner.rope_delta for w in work], self.device, torch.float32).expand(3, -1)
            attention = self.attention.plan([SeqSlice(w.seq.blocks, w.start, 1) for w in work])
            embeds = self.model.model.embed_tokens(ids)
            with step_context(attention, self.moe, self.triton_linear):
                hidden, captured = self.model(embeds, positions, capture_layer=self.accept_layer if sending else None)
            logits = self.model.lm_head(hidden)
            if sending:
                states = embeds, captured
        self.scheduler.advance(work)
        tokens = drawn if drawn is not None else sample_batch(logits, [w.seq.owner.params for w in work], counters=counters)
        carried = host is not None  # `carry` holds this step's tokens: the graph's draws
        fence = (self.decode.last_staging, event) if carried else None  # `event` is the graph's, or after it
        if not tokens.is_cuda:
            host = tokens
        elif host is None or states is not None:  # to the host without waiting: read when the next step has been launched
            if host is None:
                host, event = self._launch_buffers(n)
                host.copy_(tokens, non_blocking=True)
            if states is not None and self.host_states:  # with them, the speech rows' states (host_states)
                states = tuple(_pinned_copy(t) for t in states)
            if states is not None:  # its own event, after the states' copies: one handed out with states (ready) is theirs
                event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        if sending:
            for w, sent in zip(work, send):
                if sent:
                    w.seq.states_sent = w.start + 1
        # A placeholder for each row's token, but where that token ends it by length (no further step for it)
        placeholders = [c + 1 < o.params.max_tokens for o, c in zip(owners, counters)]
        for state, placeholder in zip(seq_states, placeholders):
            if placeholder:
                state.tokens.append(PLACEHOLDER)
        self.overlapped += prev is not None
        self.laps.lap("queue")
        return _Pending(work, tokens, host, event, placeholders, row_of, send, states, carried, fence)

    def _launch_buffers(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A launched step's pinned buffer for its `n` tokens and the event of their copy: two sets used in turn,
        as a step's tokens are read (_finish) before the step after next is launched."""
        self._launch_turn ^= 1
        if self._launched[self._launch_turn] is None or len(self._launched[self._launch_turn][0]) < n:
            self._launched[self._launch_turn] = (torch.empty(max(n, 256), dtype=torch.long, pin_memory=True),
                                                 torch.cuda.Event())
        host, copied = self._launched[self._launch_turn]
        return host[:n], copied

    def _finish(self, p: "_Pending") -> list[tuple[ThinkerSeq, ThinkerStep]]:
        """The pending step's tokens, read now (its device work is done or nearly): each placeholder filled,
        each request's output as `_outputs` makes it. Rows of requests freed or ended meanwhile are dropped."""
        t_wait, c_wait = time.perf_counter(), time.thread_time()
        if p.event is not None:
            wait(p.event, self.spin_wait)
            if p.fence is not None:  # the graph's staging buffer is free again: its next fill asks the driver nothing
                p.fence[0].reached(p.fence[1])
        tokens = p.host.tolist()
        waited = time.perf_counter() - t_wait
        self.last_wait_s += waited
        self.laps.waited(waited, time.thread_time() - c_wait)
        out, live = [], self.states
        for row, (w, token, placeholder) in enumerate(zip(p.work, tokens, p.placeholders)):
            state = w.seq
            seq: ThinkerSeq = state.owner
            if live.get(id(seq)) is not state or seq.done:
                continue
            if placeholder:
                state.tokens[w.start + 1] = token
            else:
                state.tokens.append(token)
            step = ThinkerStep([])
            if p.states is not None and p.send[row]:
                step.state_start, step.embeds, step.hidden = w.start, p.states[0][row:row + 1], p.states[1][row:row + 1]
                # States on the device were copied before the event; on the host they are complete already (read
                # after it).
                step.ready = p.event if step.embeds.is_cuda else None
            out.append((seq, accept(seq, step, token)))
        self.laps.lap("finish")
        return out
