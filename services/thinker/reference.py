"""The reference thinker engine: transformers' own Qwen3-Omni thinker LM, one request per forward.

It is the baseline faster engines are measured against and the reference they are tested against:
plain, with a DynamicCache per request and no batching across requests.
"""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from services.llm.sampling import SamplingParams, sample_next
from services.model.load import load_component
from services.model.spec import OmniSpec
from services.runtime.errors import InvalidArgument


@dataclass
class Span:
    """Embeddings that replace prompt_ids[offset : offset + len(embeds)]."""
    offset: int
    embeds: torch.Tensor  # [n, H]
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per tap, [n, H]; vision only


@dataclass
class ThinkerSeq:
    request_id: str
    prompt_ids: torch.Tensor  # [L] int64
    params: SamplingParams
    positions: torch.Tensor | None = None  # [3, L] float32; None: 0, 1, 2, ...
    rope_delta: float = 0.0
    spans: list[Span] = field(default_factory=list)
    return_states: bool = False
    embed_token_ids: list[int] = field(default_factory=list)
    # engine state
    done: bool = False
    stop_reason: str = ""  # "eos" | "length"
    generated: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    generator: torch.Generator | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    arrived: float = field(default_factory=time.perf_counter)  # made when the request reached the stage
    started: float = 0.0  # when a step first computed it (its wait: started - arrived)
    # len(prompt_ids), kept: a tensor's len() runs torch's Python __len__, and a decode step asked for every row's
    # three times (800 calls over 8 steps at 32 requests in bench/results/profile-1xh200-b32-decode-fp8a8-a7aa69a.txt).
    prompt_len: int = field(init=False, default=0)

    def __post_init__(self):
        self.prompt_len = len(self.prompt_ids)

    @property
    def n_cached(self) -> int:
        return 0 if self.cache is None else len(self.prompt_ids) + len(self.generated) - 1


@dataclass
class ThinkerStep:
    token_ids: list[int]
    state_start: int = 0
    embeds: torch.Tensor | None = None  # [n, H] decoder input embeddings of the positions just processed
    hidden: torch.Tensor | None = None  # [n, H] accept_hidden_layer output of those positions
    token_embeds: torch.Tensor | None = None
    stop_reason: str = ""
    # A CUDA event recorded once the tensors above are queued: a consumer waits for it alone, not for whatever
    # the engine queued after (None: they are complete, or on the CPU).
    ready: object = None


def validate(seq: ThinkerSeq, vocab: int, hidden: int, has_states: bool) -> None:
    n = len(seq.prompt_ids)
    if n == 0:
        raise InvalidArgument("empty prompt")
    if int(seq.prompt_ids.max()) >= vocab or int(seq.prompt_ids.min()) < 0:
        raise InvalidArgument(f"prompt token ids must lie in [0, {vocab})")
    if seq.positions is not None and tuple(seq.positions.shape) != (3, n):
        raise InvalidArgument(f"positions must be 3 x {n}, got {tuple(seq.positions.shape)}")
    if seq.return_states and not has_states:
        raise InvalidArgument("this checkpoint has no talker: states cannot be returned")
    for span in seq.spans:
        rows, width = span.embeds.shape
        if span.offset < 0 or span.offset + rows > n or width != hidden or any(d.shape != span.embeds.shape for d in span.deepstack):
            raise InvalidArgument(f"multimodal span at {span.offset} of shape {tuple(span.embeds.shape)} does not fit a prompt of {n} x {hidden}")


def accept(seq: ThinkerSeq, step: ThinkerStep, token: int) -> ThinkerStep:
    """`token` is the request's next: its output, and whether it ends the request ('eos' or 'length' as its stop
    reason). Every decode step runs this for each of its requests."""
    generated = seq.generated
    generated.append(token)
    step.token_ids = [token]
    p, n = seq.params, len(generated)
    if token in p.stop_token_ids and not p.ignore_eos and n >= p.min_tokens:
        seq.stop_reason = step.stop_reason = "eos"
    elif n >= p.max_tokens:
        seq.stop_reason = step.stop_reason = "length"
    else:
        seq.stop_reason = step.stop_reason = ""
    seq.done = bool(seq.stop_reason)
    return step


class ReferenceThinker:
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32, load_format: str = "auto", seed: int = 0):
        self.device, self.dtype = torch.device(device), dtype
        self.lm = load_component("thinker", model_dir, device, dtype, load_format, seed)
        spec = OmniSpec.load(model_dir)
        self.accept_layer = spec.talker["accept_hidden_layer"] if spec.has_talker else None
        self.vocab = spec.thinker["text_config"]["vocab_size"]
        self.hidden_size = spec.thinker_hidden

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.lm.model.embed_tokens

    def add(self, seq: ThinkerSeq) -> None:
        validate(seq, self.vocab, self.hidden_size, self.accept_layer is not None)
        seq.generator = seq.params.generator(self.device)

    def ready(self, seq: ThinkerSeq) -> bool:
        return not seq.done

    def free(self, seq: ThinkerSeq) -> None:
        seq.cache = None

    @torch.no_grad()
    def step(self, seqs: list[ThinkerSeq]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        return [(seq, self._step(seq)) for seq in seqs]

    def _prefill_inputs(self, seq: ThinkerSeq):
        ids = seq.prompt_ids.to(self.device)
        n = len(ids)
        embeds = self.embed(ids)
        visual = torch.zeros(n, dtype=torch.bool, device=self.device)
        taps: list[list[torch.Tensor]] = []
        for span in sorted(seq.spans, key=lambda s: s.offset):
            rows = len(span.embeds)
            embeds[span.offset:span.offset + rows] = span.embeds.to(self.device, self.dtype)
            if span.deepstack:
                visual[span.offset:span.offset + rows] = True
                taps.append([d.to(self.device, self.dtype) for d in span.deepstack])
        deepstack = [torch.cat(level) for level in zip(*taps)] if taps else None
        pos = seq.positions if seq.positions is not None else torch.arange(n, dtype=torch.float32).expand(3, n)
        text_row = torch.arange(n, dtype=torch.float32)[None]
        position_ids = torch.cat([text_row, pos.float()])[:, None].to(self.device)  # [4, 1, L]
        return embeds[None], position_ids, deepstack, (visual[None] if taps else None)

    def _step(self, seq: ThinkerSeq) -> ThinkerStep:
        t0 = time.perf_counter()
        seq.started = seq.started or t0
        prefill = seq.cache is None
        if prefill:
            embeds, position_ids, deepstack, visual_mask = self._prefill_inputs(seq)
            seq.cache = DynamicCache(config=self.lm.model.config)
            start = 0
        else:
            start = seq.n_cached
            embeds = self.embed(torch.tensor([[seq.generated[-1]]], device=self.device))
            p = start + seq.rope_delta
            position_ids = torch.tensor([[start], [p], [p], [p]], dtype=torch.float32, device=self.device)[:, None]
            deepstack = visual_mask = None
        total = start + embeds.shape[1]
        out = self.lm.model(
            inputs_embeds=embeds, position_ids=position_ids, past_key_values=seq.cache, use_cache=True,
            attention_mask=torch.ones(1, total, dtype=torch.long, device=self.device),
            output_hidden_states=seq.return_states, deepstack_visual_embeds=deepstack, visual_pos_masks=visual_mask,
        )
        # All positions through lm_head, as transformers' generate does, so float results match it.
        logits = self.lm.lm_head(out.last_hidden_state)[0, -1]
        p = seq.params
        history = None
        if p.repetition_penalty != 1.0:
            history = torch.cat([seq.prompt_ids, torch.tensor(seq.generated, dtype=torch.long)]).to(self.device)
        token = sample_next(logits, p, len(seq.generated), history, None, seq.generator)
        result = ThinkerStep(token_ids=[], state_start=start)
        if seq.return_states:
            result.embeds = out.hidden_states[0][0]
            result.hidden = out.hidden_states[self.accept_layer][0]
        if prefill and seq.embed_token_ids:
            result.token_embeds = self.embed(torch.tensor(seq.embed_token_ids, device=self.device))
        accept(seq, result, token)
        elapsed = time.perf_counter() - t0
        if prefill:
            seq.prefill_seconds += elapsed
        else:
            seq.decode_seconds += elapsed
        return result
