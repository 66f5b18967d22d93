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
