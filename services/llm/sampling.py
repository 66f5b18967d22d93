"""The next token from logits: repetition penalty, minimum length, suppressed ids, then greedy or
temperature / top-k / top-p sampling (transformers' order).

Seeded draws use noise hashed from (seed, counter), so a row draws the same token in any batch, in or out of a graph."""

import math
from dataclasses import dataclass, field

import torch

from omni.stage.v1 import common_pb2
from services.llm.fusion import fusable
from services.llm.host import scalar, upload
from services.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int = 0
    ignore_eos: bool = False  # EOS neither ends the sequence nor is avoided (fixed-length benchmarks)
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed) if self.seed else gen.seed()
        return gen


def sampling_from_proto(msg: common_pb2.Sampling) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k, max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens, seed=msg.seed, ignore_eos=msg.ignore_eos,
        repetition_penalty=msg.repetition_penalty or 1.0, stop_token_ids=tuple(msg.stop_token_ids),
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.Sampling:
    return common_pb2.Sampling(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
        seed=p.seed, ignore_eos=p.ignore_eos, repetition_penalty=p.repetition_penalty, stop_token_ids=list(p.stop_token_ids),
    )


def check_params(p: SamplingParams, vocab: int, max_tokens: int, where: str = "sampling") -> None:
    """Refuses settings a step cannot draw with, naming the field: at most `max_tokens`, stop ids below `vocab`."""
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidArgument(f"{where}.temperature must be a finite number >= 0, got {p.temperature}")
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise InvalidArgument(f"{where}.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidArgument(f"{where}.top_k must be >= 0, got {p.top_k}")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        raise InvalidArgument(f"{where}.repetition_penalty must be a finite number > 0, got {p.repetition_penalty}")
    if not 1 <= p.max_tokens <= max_tokens:
        raise InvalidArgument(f"{where}.max_tokens must be in [1, {max_tokens}], got {p.max_tokens}")
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise InvalidArgument(f"{where}.min_tokens must be in [0, max_tokens], got {p.min_tokens}")
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"{where}.stop_token_ids must lie in [0, {vocab}), got {bad[0]}")


def check_ids(ids, vocab: int, field: str) -> torch.Tensor:
    """`ids` as a tensor, each in [0, vocab), else INVALID_ARGUMENT naming `field`."""
    t = torch.tensor(ids, dtype=torch.long)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise InvalidArgument(f"{field} must lie in [0, {vocab})")
    return t


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty == 1.0 or history.numel() == 0:
        return logits
    score = logits.gather(-1, history)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(-1, history, score)


def sample_next(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    generated: int,
    history: torch.Tensor | None = None,  # ids the repetition penalty applies to
    suppress: torch.Tensor | None = None,  # ids never to choose
    generator: torch.Generator | None = None,
) -> int:
    logits = logits.float()
    if history is not None:
        logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if generated < params.min_tokens and params.stop_token_ids:
        logits = logits.index_fill(-1, torch.tensor(params.stop_token_ids, device=logits.device), float("-inf"))
    if suppress is not None and suppress.numel():
        logits = logits.index_fill(-1, suppress, float("-inf"))
    if params.temperature == 0:
        return int(logits.argmax(-1))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - params.top_p
        remove[-1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _padded(histories: list, device) -> torch.Tensor:
    """Histories as one [rows, longest] tensor, padded with each row's first id: a repeated id changes nothing."""
    longest = max(len(h) for h in histories)
    if all(not isinstance(h, torch.Tensor) for h in histories):
        padded = [list(h) + [h[0]] * (longest - len(h)) for h in histories]
        return upload(padded, torch.device(device), torch.long)
    rows = [torch.as_tensor(h, device=device).long() for h in histories]
    return torch.stack([torch.cat([r, r[:1].expand(longest - len(r))]) for r in rows])


CANDIDATES = 64  # the best logits a captured step draws among
SORTED_VOCAB = 4096  # up to this, one stable sort beats a top-k and the two sorts that order its ties


def hashed_exponential(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential(1) noise [S, vocab] from (seed, counter, column) alone: the same in any batch, on any device."""
    m = 0xFFFFFFFF
    x = (seeds[:, None] * 0x2545F491 + (seeds[:, None] >> 32) * 0x6C8E9CF5 + counters[:, None] * 0x9E3779B1
         + torch.arange(vocab, device=seeds.device)) & m
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):  # lowbias32: every input bit moves every output bit
        x = ((x ^ (x >> shift)) * mult) & m
    x = x ^ (x >> 16)
    u = ((x >> 8).float() + 0.5) * 2.0**-24  # strictly inside (0, 1)
    return -u.log()


@fusable
def sample_tensors(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   seeds: torch.Tensor, counters: torch.Tensor, k: int) -> torch.Tensor:
    """sample_batch's draw with every setting a tensor [B] and no host decision, so a graph can hold it."""
    logits = logits.float()
    probs, order = _candidates(logits, torch.where(temps > 0, temps, 1.0), top_k, top_p, k)
    noise = hashed_exponential(seeds, counters, k)
    noise = torch.where(seeds[:, None] != 0, noise, torch.empty_like(probs).exponential_())
    return torch.where(temps > 0, _race(probs, order, noise), argmax_rows(logits))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [B, V] in two reductions over 256 chunks: one reduction runs a program a row, far too few."""
    b, v = x.shape
    if v < 1 << 14 or v % 256:
        return x.argmax(-1)
    best, at = x.view(b, 256, v // 256).max(-1)
    chunk = best.argmax(-1, keepdim=True)  # the first chunk with the maximum: ties go to the first id
    return (chunk * (v // 256) + at.gather(-1, chunk))[:, 0]


def tensor_drawable(p: SamplingParams, generated: int, k: int = CANDIDATES) -> bool:
    """Whether sample_tensors gives this row sample_batch's token: greedy or top-k below `k`, no host-side cases."""
    return (p.repetition_penalty == 1.0 and not (generated < p.min_tokens and p.stop_token_ids)
            and (p.temperature == 0 or 0 < p.top_k < k))


def _candidates(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int):
    """-> (probs [B, k], ids [B, k]) of each row's best `k`, zero past its top_k and outside its top_p head."""
    scaled = logits / temps[:, None]
    if scaled.shape[-1] <= SORTED_VOCAB:  # one stable sort of the row: best first, equal logits in id order
        scaled, order = scaled.sort(dim=-1, descending=True, stable=True)
        scaled, order = scaled[:, :k], order[:, :k]
    else:
        scaled, order = scaled.topk(k, dim=-1)
        # topk orders ties (common in bf16) as its kernel happens to: id order makes a row's draw the same anywhere
        order, by_id = order.sort(dim=-1)
        scaled, rank = scaled.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        order = order.gather(-1, rank)
    scaled = scaled.masked_fill(torch.arange(k, device=logits.device) >= top_k[:, None], float("-inf"))
    probs = scaled.softmax(-1)
    return probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0), order


def _race(probs: torch.Tensor, order: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: with Exponential(1) noise per candidate, argmax(probs / noise) draws from probs."""
    return order.gather(-1, (probs / noise).argmax(-1, keepdim=True))[:, 0]


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seen: list | None = None,
                 generated: list[int] | None = None, suppress: list[torch.Tensor | None] | None = None,
                 counters: list[int] | None = None) -> torch.Tensor:
    """A token per row of `logits` [B, V] by batched ops, the host deciding which rows need what, nothing waiting."""
    b, vocab = logits.shape
    dev = logits.device
    logits = logits.float()
    penalised = [i for i, p in enumerate(params)
                 if seen is not None and seen[i] is not None and len(seen[i]) and p.repetition_penalty != 1.0]
    banned = {i: list(p.stop_token_ids) for i, p in enumerate(params)
              if generated is not None and generated[i] < p.min_tokens and p.stop_token_ids}
    shared: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(suppressed ids) -> (ids, rows)
    for i, ids in enumerate(suppress or ()):
        if ids is not None and len(ids):
            shared.setdefault(id(ids), (torch.as_tensor(ids, device=dev), []))[1].append(i)
    if penalised or banned or shared:
        logits = logits.clone()
    if penalised:
        rows = upload(penalised, dev)
        hist = _padded([seen[i] for i in penalised], dev)
        score = logits[rows[:, None], hist]
        pen = upload([params[i].repetition_penalty for i in penalised], dev)[:, None]
        logits[rows[:, None], hist] = torch.where(score < 0, score * pen, score / pen)
    for ids, rows in shared.values():
        logits[upload(rows, dev)[:, None], ids[None, :]] = scalar(float("-inf"), logits)
    if banned:
        rows = [i for i in banned for _ in banned[i]]
        cols = [c for i in banned for c in banned[i]]
        at = upload([rows, cols], dev)
        logits[at[0], at[1]] = scalar(float("-inf"), logits)
    out = logits.argmax(-1)
    picked_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not picked_rows:
        return out
    picked = [params[i] for i in picked_rows]
    ints = upload([picked_rows, [p.top_k or vocab for p in picked], [p.seed & (2**63 - 1) for p in picked],
                   [counters[i] if counters is not None else 0 for i in picked_rows]], dev, torch.long)
    floats = upload([[p.temperature for p in picked], [p.top_p for p in picked]], dev, torch.float32)
    rows, top_k, seeds, steps = ints
    temps, top_p = floats
    # At least CANDIDATES: the candidates a graph's sample_tensors takes, ties at rank k cut the same way
    k = min(max(CANDIDATES, *(p.top_k or vocab for p in picked)), vocab)
    probs, order = _candidates(logits[rows], temps, top_k, top_p, k)
    hashed = [j for j, p in enumerate(picked) if p.seed]
    if len(hashed) == len(picked):
        noise = hashed_exponential(seeds, steps, k)  # per candidate rank
    else:
        noise = torch.empty_like(probs).exponential_()
        if hashed:
            at = upload(hashed, dev)
            noise[at] = hashed_exponential(seeds[at], steps[at], k)
    out[rows] = _race(probs, order, noise)
    return out
