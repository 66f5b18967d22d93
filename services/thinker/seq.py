"""The thinker's request (ThinkerSeq), what a step hands out for it (ThinkerStep), its checks and its end."""

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from services.llm.sampling import SamplingParams
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
    arrived: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when a step first computed it
    prompt_len: int = field(init=False, default=0)  # a tensor's len() is a slow Python call, and this is hot

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
    ready: object = None  # an event after the tensors above, so a consumer need not wait for later work


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
    """`token` is the request's next: its output, with 'eos' or 'length' where it ends the request."""
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
