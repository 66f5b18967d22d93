"""Choosing the next token from logits: repetition penalty, minimum length, suppressed ids, then greedy
or temperature / top-k / top-p sampling from a per-request generator (transformers' order)."""

from dataclasses import dataclass, field

import torch


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


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """Scores of tokens already seen are divided by `penalty` (multiplied when negative)."""
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


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 seen: list[torch.Tensor | None] | None = None, generated: list[int] | None = None,
                 suppress: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V], with tensor ops over the batch: rows loop in Python only where a
    request asks for something per row (a seed, a repetition penalty, a minimum length)."""
    logits = logits.float().clone()
    b, vocab = logits.shape
    dev = logits.device
    for i, p in enumerate(params):
        if seen is not None and seen[i] is not None and p.repetition_penalty != 1.0:
            logits[i] = apply_repetition_penalty(logits[i], seen[i], p.repetition_penalty)
        if generated is not None and generated[i] < p.min_tokens and p.stop_token_ids:
            logits[i, list(p.stop_token_ids)] = float("-inf")
        if suppress is not None and suppress[i] is not None:
            logits[i, suppress[i]] = float("-inf")
    temps = torch.tensor([p.temperature for p in params], device=dev)
    out = logits.argmax(-1)
    rows = (temps > 0).nonzero()[:, 0]
    if rows.numel() == 0:
        return out
    picked = [params[i] for i in rows.tolist()]
    scaled, order = (logits[rows] / temps[rows, None]).sort(-1, descending=True)  # [S, V], best first
    rank = torch.arange(vocab, device=dev)
    top_k = torch.tensor([p.top_k or vocab for p in picked], device=dev)
    scaled = scaled.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = scaled.softmax(-1)
    top_p = torch.tensor([p.top_p for p in picked], device=dev)
    probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0)  # the smallest head holding top_p
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(rows.tolist()) if generators[i] is None]
    if shared:
        noise[shared] = torch.empty(len(shared), vocab, device=dev).exponential_()
    for j, i in enumerate(rows.tolist()):
        if generators[i] is not None:
            noise[j] = torch.empty(vocab, device=dev).exponential_(generator=generators[i])
    choice = (probs / noise).argmax(-1)  # the exponential race: a draw from `probs`
    out[rows] = order.gather(-1, choice[:, None])[:, 0]
    return out
