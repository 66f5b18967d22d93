"""code2wav's activations fused (talker.code2wav_fuse): transformers' Qwen3OmniMoeCode2Wav runs each SnakeBeta
as separate elementwise kernels over the whole signal; here each becomes one compiled kernel, the rest of the
module left as it is."""

import functools
import types

import torch
from torch import nn


def _snake(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor, eps: float) -> torch.Tensor:
    """SnakeBeta, x + sin(x * alpha)^2 / beta with alpha, beta = exp of the module's parameters, as transformers'
    Qwen3OmniMoeSnakeBeta computes it: x [B, C, T], the parameters [C]."""
    alpha, beta = log_alpha.exp()[None, :, None], log_beta.exp()[None, :, None]
    return x + (1.0 / (beta + eps)) * torch.pow(torch.sin(x * alpha), 2)


@functools.cache
def _fused_snake():
    return torch.compile(_snake, dynamic=True)  # one kernel for every shape: batch, channels and length symbolic


def _snake_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _fused_snake()(x, self.alpha, self.beta, self.no_div_by_zero)


def fuse_activations_(code2wav: nn.Module) -> int:
    """Each SnakeBeta activation of `code2wav` as one compiled kernel (talker.code2wav_fuse): eager, it is five
    passes over the whole signal (a multiply, a sine, a square, a multiply, an add, each reading and writing it)
    and a few small ones for its parameters, and code2wav runs 29 of them, most at its highest sample rates. The same arithmetic, rounded once. Returns how
    many were fused."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

    snakes = [m for m in code2wav.modules() if isinstance(m, Qwen3OmniMoeSnakeBeta)]
    for m in snakes:
        m.forward = types.MethodType(_snake_forward, m)
    return len(snakes)
