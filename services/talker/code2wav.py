"""code2wav's decoder run natively: the same arithmetic as transformers' Qwen3OmniMoeCode2Wav, rounded less often.

The decoder's convolutions are the arithmetic; in transformers' module the time goes around them: each SnakeBeta is
five passes over the whole signal, each convolution's bias one more, each causal pad a copy, cuDNN converts every
convolution's input and output between channel layouts, and one convolution (dilation 9 at 384 channels) gets a
slow fallback kernel.

The native decoder keeps the signal channels-last ([B, T, C]), which cuDNN's tensor-core kernels and cuBLAS read
as they are, and runs each stretch between two convolutions as one pass (`snake_rows`): the bias, the residual,
SnakeBeta, written straight into the next convolution's zero-padded input. A dilated convolution runs as an
undilated one over the signal folded by its dilation (a view, no copy): out[t] reads x[t + k*d], which in
[T/d, d] is row h + k of column w. The pointwise convolutions are GEMMs with their bias in cuBLAS's epilogue.
The pre-transformer and the upsampling blocks before the decoder (at 2 to 4 times the frame rate) stay
transformers'.

A streaming chunk's waveform is kept only after its left context, and the decoder is causal: the first kept sample
depends on the decoder's inputs at most a few rows before it. So the decoder starts where the kept samples need it
to (`first_row`), not at the chunk's first frame, the kept samples the same.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: snake_rows' torch path
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
        rows = (b * T + t) * C + c  # the residual and y: contiguous [B, T, C]
        if HAS_RES:
            y += tl.load(res_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        if KEEP:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=mask)
        s = tl.sin(y * tl.load(alpha_ptr + c, mask=cm, other=0.0))
        z = y + tl.load(inv_beta_ptr + c, mask=cm, other=0.0) * s * s
        tl.store(z_ptr + b * stride_zb + t * C + c, z.to(z_ptr.dtype.element_ty), mask=mask)


def snake_rows(a: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, z: torch.Tensor, bias=None, residual=None,
               y=None) -> None:
    """One pass over a channels-last signal a [B, T, C] (rows of contiguous channels, any batch and row strides):
    y = a + bias + residual (each optional; kept in `y` if given, [B, T, C] contiguous), then SnakeBeta
    z = y + inv_beta * sin(alpha * y)^2 written into z [B, T, C] (contiguous channels and rows, any batch stride:
    the inside of the next convolution's padded input). Float32 inside, one rounding per output."""
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
    """A SnakeBeta's parameters as the kernel reads them: alpha and 1 / (beta + eps), float32 [C]."""

    def __init__(self, m: nn.Module):
        self.alpha = m.alpha.detach().float().exp()
        self.inv_beta = 1.0 / (m.beta.detach().float().exp() + m.no_div_by_zero)


class _Conv:
    """A causal convolution (Qwen3OmniMoeCausalConvNet, stride 1) over a channels-last signal: its input is made
    with `lead` zero rows before the signal and `trail` after (padded to whole folds of the dilation), its
    weight as a 2-D kernel of (K, 1) over the signal folded [T / d, d], channels-last."""

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
        """The zero-padded input buffer [B, lead + T + trail, C] and its inside [B, T, C] to write the signal to."""
        buf = torch.empty(B, self.lead + T + self.trail(T), self.c_in, dtype=like.dtype, device=like.device)
        buf[:, :self.lead].zero_()
        buf[:, self.lead + T:].zero_()
        return buf, buf[:, self.lead:self.lead + T]

    def __call__(self, buf: torch.Tensor, T: int, with_bias: bool = False) -> torch.Tensor:
        """The convolution of the padded input `buf` (from `input`): [B, T, Cout], without its bias unless asked
        (a view whose rows are contiguous)."""
        B = buf.shape[0]
        if self.pointwise:
            return F.linear(buf, self.weight, self.bias if with_bias else None)
        folded = buf.view(B, buf.shape[1] // self.d, self.d, self.c_in).permute(0, 3, 1, 2)  # [B, Cin, H, d]
        out = F.conv2d(folded, self.weight, self.bias if with_bias else None)  # [B, Cout, H - K + 1, d]
        return out.permute(0, 2, 3, 1).reshape(B, -1, self.c_out)[:, :T]


class _Upsample:
    """A causal transposed convolution (Qwen3OmniMoeCausalTransConvNet: kernel 2r, stride r, r outputs trimmed
    from each end) over a channels-last signal, without its bias: [B, T, Cin] -> [B, (T - 1) * r, Cout], a view."""

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
    """transformers' Qwen3OmniMoeCode2Wav with its decoder run channels-last (the module's docstring): the same
    call, codes [B, groups, frames] -> waveforms [B, 1, samples] as the module makes them. The decoder's weights
    are read when it is made, its convolutions' copied into the layouts it reads (the pre-transformer's and the
    upsampling blocks' stay the module's own)."""

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
        self.row_samples = math.prod(up.r for _, up, _ in self.blocks)  # each decoder row (its input) becomes these

    def first_row(self, skip: int) -> int:
        """The first decoder row the waveform from sample `skip` on depends on (forward's `start`), followed back
        through the decoder: each causal convolution reads `lead` samples before its output, an upsampler's output
        sample s reads its input samples s // r and the next."""
        e = skip - self.last.lead
        for _, up, units in reversed(self.blocks):
            e = (e - sum(conv1.lead for _, conv1, _, _ in units)) // up.r
        return max(0, e - self.first.lead)

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        """The decoder's input [B, C, rows] as transformers' module makes it: codes embedded, the pre-transformer,
        the upsampling blocks."""
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
        """The waveforms from sample start * row_samples on (those from first_row(skip) on are the module's from
        that sample: earlier ones may differ, the decoder's causal convolutions reading zeros before `start`)."""
        x = self.decoder_input(codes).transpose(1, 2)[:, start:]  # [B, T, C]: the first convolution's input
        B, T, _ = x.shape
        buf, inside = self.first.input(B, T, x)
        inside.copy_(x)
        # Between two convolutions, the signal is `a` (a convolution's output) plus `bias` plus `residual` (either
        # may be None), summed by the next snake_rows pass.
        a, bias, residual = self.first(buf, T), self.first.bias, None
        for snake, up, units in self.blocks:
            z = torch.empty(B, T, a.shape[2], dtype=a.dtype, device=a.device)
            snake_rows(a, snake.alpha, snake.inv_beta, z, bias=bias, residual=residual)  # the block's first SnakeBeta
            a, bias, residual = up(z), up.bias, None
            T = a.shape[1]  # (T - 1) * r: the trim takes r from either end
            for act1, conv1, act2, conv2 in units:
                x = torch.empty(B, T, up.c_out, dtype=a.dtype, device=a.device)  # the unit's input: its residual
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
