"""code2wav's decoder run natively: transformers' Qwen3OmniMoeCode2Wav's arithmetic, rounded less often.

In transformers' module the time goes around the convolutions (SnakeBeta's passes, biases, pads, layout changes).
Here the signal stays channels-last [B, T, C] and each stretch between two convolutions is one pass (`snake_rows`)
written into the next convolution's padded input. A dilated convolution runs undilated over the signal folded
[T/d, d] (a view). The decoder is causal, so a chunk starts where its kept samples need it (`first_row`)."""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: snake_rows' torch path
    triton = None


if triton is not None:
    @triton.jit
    def _snake_rows_kernel(a_ptr, stride_ab, stride_at, bias_ptr, res_ptr, y_ptr, z_ptr, stride_zb, alpha_ptr, inv_beta_ptr,
                           T, C, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, KEEP: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b, pt, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = pt * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        c = pc * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        mask = (t < T) & (c < C)
        y = tl.load(a_ptr + b * stride_ab + t * stride_at + c, mask=mask, other=0.0).to(tl.float32)
        cm = c < C
        if HAS_BIAS:
            y += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        rows = (b * T + t) * C + c  # residual and y are contiguous [B, T, C]
        if HAS_RES:
            y += tl.load(res_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        if KEEP:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=mask)
        s = tl.sin(y * tl.load(alpha_ptr + c, mask=cm, other=0.0))
        z = y + tl.load(inv_beta_ptr + c, mask=cm, other=0.0) * s * s
        tl.store(z_ptr + b * stride_zb + t * C + c, z.to(z_ptr.dtype.element_ty), mask=mask)


def snake_rows(a: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, z: torch.Tensor, bias=None, residual=None,
               y=None) -> None:
    """y = a + bias + residual (kept in `y`), z = y + inv_beta * sin(alpha * y)^2 over [B, T, C], in one pass."""
    B, T, C = a.shape
    if a.is_cuda and triton is not None or os.environ.get("TRITON_INTERPRET") == "1":
        assert a.stride(2) == 1 and z.stride(2) == 1 and z.stride(1) == C and z.shape == a.shape
        assert (residual is None or residual.is_contiguous()) and (y is None or y.is_contiguous())
        assert max(a.stride(0), z.stride(0), T * C) * B < 2**31, "offsets past int32: the kernel's arithmetic is 32-bit"
        BLOCK_C = min(triton.next_power_of_2(C), 128)
        grid = (B, triton.cdiv(T, 32), triton.cdiv(C, BLOCK_C))
        _snake_rows_kernel[grid](a, a.stride(0), a.stride(1), bias if bias is not None else a,
                                 residual if residual is not None else a, y if y is not None else a, z, z.stride(0),
                                 alpha, inv_beta, T, C, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                                 KEEP=y is not None, BLOCK_T=32, BLOCK_C=BLOCK_C)
        return
    v = a.float()
    if bias is not None:
        v = v + bias.float()
    if residual is not None:
        v = v + residual.float()
    if y is not None:
        y.copy_(v)
    z.copy_(v + inv_beta * torch.sin(v * alpha) ** 2)


class _Snake:
    """A SnakeBeta's alpha and 1 / (beta + eps), float32 [C]."""

    def __init__(self, m: nn.Module):
        self.alpha = m.alpha.detach().float().exp()
        self.inv_beta = 1.0 / (m.beta.detach().float().exp() + m.no_div_by_zero)


class _Conv:
    """A causal convolution over a channels-last signal folded [T / d, d]: `lead` zero rows before, `trail` after."""

    def __init__(self, m: nn.Module):
        conv = m.conv
        assert conv.stride == (1,) and conv.groups == 1 and conv.padding == (0,), "code2wav's causal convolutions"
        self.k, self.d = conv.kernel_size[0], conv.dilation[0]
        self.lead = (self.k - 1) * self.d
        w = conv.weight.detach()
        self.pointwise = self.k == 1
        self.weight = w[:, :, 0].contiguous() if self.pointwise else \
            w.unsqueeze(-1).contiguous(memory_format=torch.channels_last)  # [Cout, Cin, K, 1]
        self.bias = None if conv.bias is None else conv.bias.detach()
        self.c_in, self.c_out = w.shape[1], w.shape[0]

    def trail(self, t: int) -> int:
        return -t % self.d

    def input(self, B: int, T: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The zero-padded input [B, lead + T + trail, C] and its inside [B, T, C]."""
        buf = torch.empty(B, self.lead + T + self.trail(T), self.c_in, dtype=like.dtype, device=like.device)
        buf[:, :self.lead].zero_()
        buf[:, self.lead + T:].zero_()
        return buf, buf[:, self.lead:self.lead + T]

    def __call__(self, buf: torch.Tensor, T: int, with_bias: bool = False) -> torch.Tensor:
        """The convolution of `buf` (from `input`) -> [B, T, Cout], bias only if asked."""
        B = buf.shape[0]
        if self.pointwise:
            return F.linear(buf, self.weight, self.bias if with_bias else None)
        folded = buf.view(B, buf.shape[1] // self.d, self.d, self.c_in).permute(0, 3, 1, 2)  # [B, Cin, H, d]
        out = F.conv2d(folded, self.weight, self.bias if with_bias else None)  # [B, Cout, H - K + 1, d]
        return out.permute(0, 2, 3, 1).reshape(B, -1, self.c_out)[:, :T]


class _Upsample:
    """A causal transposed convolution, no bias: [B, T, Cin] -> [B, (T - 1) * r, Cout]."""

    def __init__(self, m: nn.Module):
        conv = m.conv
        self.r, self.trim = conv.stride[0], m.left_pad
        assert m.left_pad == m.right_pad and conv.kernel_size[0] == 2 * self.r
        self.weight = conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)  # [Cin, Cout, 1, K]
        self.bias = conv.bias.detach()
        self.c_out = conv.weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        out = F.conv_transpose2d(x.view(B, 1, T, C).permute(0, 3, 1, 2), self.weight, stride=(1, self.r))
        full = out.permute(0, 2, 3, 1).reshape(B, -1, self.c_out)  # [B, (T + 1) * r, Cout]
        return full[:, self.trim:full.shape[1] - self.trim]


class NativeCode2Wav(nn.Module):
    """transformers' module with the decoder run natively: codes [B, groups, frames] -> waveforms [B, 1, samples]."""

    def __init__(self, code2wav: nn.Module):
        super().__init__()
        self.inner = code2wav
        self.total_upsample = code2wav.total_upsample
        dec = code2wav.decoder
        self.first = _Conv(dec[0])
        self.blocks = []
        for block in dec[1:-2]:
            snake, up, *units = block.block
            self.blocks.append((_Snake(snake), _Upsample(up),
                                [(_Snake(u.act1), _Conv(u.conv1), _Snake(u.act2), _Conv(u.conv2)) for u in units]))
        self.last_snake, self.last = _Snake(dec[-2]), _Conv(dec[-1])
        self.row_samples = math.prod(up.r for _, up, _ in self.blocks)  # samples per decoder input row

    def first_row(self, skip: int) -> int:
        """The first decoder row sample `skip` depends on: each convolution reads `lead` back, an upsampler s // r."""
        e = skip - self.last.lead
        for _, up, units in reversed(self.blocks):
            e = (e - sum(conv1.lead for _, conv1, _, _ in units)) // up.r
        return max(0, e - self.first.lead)

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        """The decoder's input [B, C, rows], by transformers' module."""
        m = self.inner
        if codes.shape[1] != m.config.num_quantizers:
            raise ValueError(f"Expected {m.config.num_quantizers} layer of codes, got {codes.shape[1]}")
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        hidden = m.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        for blocks in m.upsample:
            for block in blocks:
                hidden = block(hidden)
        return hidden

    @torch.no_grad()
    def forward(self, codes: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Waveforms from sample start * row_samples; those from first_row(skip) on are the module's."""
        x = self.decoder_input(codes).transpose(1, 2)[:, start:]  # [B, T, C]
        B, T, _ = x.shape
        buf, inside = self.first.input(B, T, x)
        inside.copy_(x)
        # Between convolutions the signal is a + bias + residual, summed by the next snake_rows
        a, bias, residual = self.first(buf, T), self.first.bias, None
        for snake, up, units in self.blocks:
            z = torch.empty(B, T, a.shape[2], dtype=a.dtype, device=a.device)
            snake_rows(a, snake.alpha, snake.inv_beta, z, bias=bias, residual=residual)
            a, bias, residual = up(z), up.bias, None
            T = a.shape[1]
            for act1, conv1, act2, conv2 in units:
                x = torch.empty(B, T, up.c_out, dtype=a.dtype, device=a.device)  # the unit's input, its residual
                buf, inside = conv1.input(B, T, a)
                snake_rows(a, act1.alpha, act1.inv_beta, inside, bias=bias, residual=residual, y=x)
                h = conv1(buf, T)
                z = torch.empty(B, T, conv1.c_out, dtype=a.dtype, device=a.device)
                snake_rows(h, act2.alpha, act2.inv_beta, z, bias=conv1.bias)
                a, bias, residual = conv2(z, T, with_bias=True), None, x
        buf, inside = self.last.input(B, T, a)
        snake_rows(a, self.last_snake.alpha, self.last_snake.inv_beta, inside, bias=bias, residual=residual)
        wav = self.last(buf, T, with_bias=True)  # [B, T, 1]
        return wav.clamp(min=-1, max=1).transpose(1, 2)
