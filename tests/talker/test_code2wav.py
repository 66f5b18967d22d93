"""code2wav's native decoder (services/talker/code2wav.py) against transformers'
Qwen3OmniMoeCode2Wav on the tiny model: on the CPU through snake_rows' torch path, and its Triton kernel in
Triton's CPU interpreter (a child process: the interpreter is chosen when the kernel is defined)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.model.load import load_component
from services.talker.code2wav import NativeCode2Wav, snake_rows


def snr_db(wav: torch.Tensor, ref: torch.Tensor) -> float:
    return -20 * torch.log10((wav.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def code2wav(tiny_model):
    return load_component("code2wav", tiny_model, "cpu", torch.float32, "random", 0).requires_grad_(False)


def test_native_decoder_gives_transformers_waveforms(code2wav):
    """Chunks of the streaming shapes (a first chunk of a few frames, later ones with context) and a batch: the
    same waveforms as transformers' module to float32 rounding, its length (the causal upsamplers' trim) too. The
    tiny model's decoder has every dilation (1, 3, 9) and signal lengths no whole number of folds of them."""
    native = NativeCode2Wav(code2wav)
    gen = torch.Generator().manual_seed(0)
    vocab, groups = code2wav.config.codebook_size, code2wav.config.num_quantizers
    for batch, frames in ((1, 2), (2, 7), (3, 30)):
        codes = torch.randint(0, vocab, (batch, groups, frames), generator=gen)
        with torch.no_grad():
            ref, wav = code2wav(codes), native(codes)
        assert wav.shape == ref.shape
        assert snr_db(wav, ref) > 100, (batch, frames)
    with pytest.raises(ValueError, match=f"Expected {groups} layer of codes, got {groups - 1}"):
        native(codes[:, 1:])


def test_a_decode_falls_short_by_the_tail_its_upsamplers_trim_and_no_sample_before_it_reads_later_frames(code2wav):
    """decoded_tail (what streamed chunks hand over to the next one): a decode of F frames gives F * 1920 - tail
    samples at any F, each the same as a decode of more frames gives it, the frames after F whatever they are (what
    lets a short last chunk be padded to a captured length, and the next chunk decode the tail from its context)."""
    from services.talker.chunks import decoded_tail

    tail = decoded_tail(code2wav)
    assert tail == 555  # the real upsample rates 8, 5, 4, 3: 8 * 60 + 5 * 12 + 4 * 3 + 3
    gen = torch.Generator().manual_seed(1)
    vocab, groups = code2wav.config.codebook_size, code2wav.config.num_quantizers
    codes = torch.randint(0, vocab, (1, groups, 12), generator=gen)
    with torch.no_grad():
        longer = code2wav(codes)
        for frames in (1, 4, 11):
            wav = code2wav(codes[..., :frames])
            assert wav.shape[-1] == frames * 1920 - tail
            assert torch.allclose(wav, longer[..., :wav.shape[-1]], atol=1e-6), frames
            # and the tail's samples do read the frame after: another next frame changes them, and none before them
            other = codes[..., :frames + 1].clone()
            other[..., frames] = (other[..., frames] + 1) % vocab
            changed = code2wav(other)[..., :frames * 1920] != code2wav(codes[..., :frames + 1])[..., :frames * 1920]
            assert not changed[..., :wav.shape[-1]].any() and changed[..., wav.shape[-1]:].any(), frames


def test_the_decoder_started_late_gives_the_kept_samples(code2wav):
    """A chunk of 50 frames of which the first 25 are context: first_row(skip) is the earliest decoder row the
    sample at `skip` depends on (the first row with a nonzero gradient of that sample, through transformers'
    decoder), and the native decoder started there gives the module's waveform from `skip` on."""
    native = NativeCode2Wav(code2wav)
    codes = torch.randint(0, code2wav.config.codebook_size, (2, code2wav.config.num_quantizers, 50),
                          generator=torch.Generator().manual_seed(4))
    skip = 25 * 1920
    start = native.first_row(skip)
    assert native.row_samples == 480 and start == 100 - 19 and native.first_row(18 * 480) == 0
    with torch.no_grad():
        x = native.decoder_input(codes).requires_grad_(True)  # the decoder's input [B, C, rows], transformers' own
    wav = x
    for block in code2wav.decoder:
        wav = block(wav)
    wav[0, 0, skip].backward()
    assert x.grad[0].abs().sum(0).nonzero().min().item() == start
    with torch.no_grad():
        ref = code2wav(codes)[..., skip:]
        got = native(codes, start)[..., skip - start * 480:]
    assert got.shape == ref.shape and snr_db(got, ref) > 100


def test_native_decoder_in_bfloat16_as_close_to_float32_as_transformers_bfloat16(code2wav, tiny_model):
    """In bf16 the native decoder rounds once per pass where transformers rounds after every operation: its
    waveform is at least as close to float32's (within 1 dB)."""
    bf16 = load_component("code2wav", tiny_model, "cpu", torch.bfloat16, "random", 0).requires_grad_(False)
    codes = torch.randint(0, code2wav.config.codebook_size, (2, code2wav.config.num_quantizers, 12),
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = code2wav(codes)
        theirs, ours = snr_db(bf16(codes), ref), snr_db(NativeCode2Wav(bf16)(codes), ref)
    assert ours > theirs - 1 and ours > 20, (ours, theirs)


def test_snake_rows_sums_then_activates_into_a_padded_buffer():
    """snake_rows' torch path: bias and residual summed, the sum kept where asked, SnakeBeta written into the
    inside of a padded buffer (the pad rows untouched), from a strided input (a convolution's trimmed output)."""
    gen = torch.Generator().manual_seed(2)
    B, T, C = 2, 11, 6
    a = torch.randn(B, T + 3, C, generator=gen)[:, :T]  # rows contiguous, the batch stride longer
    bias, residual = torch.randn(C, generator=gen), torch.randn(B, T, C, generator=gen)
    alpha, inv_beta = torch.rand(C, generator=gen) + 0.5, torch.rand(C, generator=gen) + 0.5
    buf = torch.full((B, 4 + T + 2, C), 7.0)
    y = torch.empty(B, T, C)
    snake_rows(a, alpha, inv_beta, buf[:, 4:4 + T], bias=bias, residual=residual, y=y)
    want_y = a + bias + residual
    assert torch.allclose(y, want_y)
    assert torch.allclose(buf[:, 4:4 + T], want_y + inv_beta * torch.sin(want_y * alpha) ** 2)
    assert (buf[:, :4] == 7).all() and (buf[:, 4 + T:] == 7).all()


CHILD = r"""
import json, sys
import torch
from services.model.load import load_component
from services.talker.code2wav import NativeCode2Wav, snake_rows

out = {}
gen = torch.Generator().manual_seed(3)
B, T, C = 2, 45, 150  # two tiles of rows and of channels, each with a ragged edge
for bias_on in (False, True):
    for res_on in (False, True):
        a = torch.randn(B, T + 5, C, generator=gen)[:, :T]
        bias, residual = torch.randn(C, generator=gen), torch.randn(B, T, C, generator=gen)
        alpha, inv_beta = torch.rand(C, generator=gen) + 0.5, torch.rand(C, generator=gen) + 0.5
        buf, y = torch.full((B, 3 + T, C), 7.0), torch.empty(B, T, C)
        snake_rows(a, alpha, inv_beta, buf[:, 3:], bias=bias if bias_on else None, residual=residual if res_on else None,
                   y=y if res_on else None)
        want_y = a + (bias if bias_on else 0) + (residual if res_on else 0)
        # in float64: in float32 this reference itself (torch's vectorised CPU ops) came out 4.5e-4 off at one
        # element in some runs (with some PYTHONHASHSEEDs), the kernel's output the same in all of them
        want_z = (want_y.double() + inv_beta.double() * torch.sin(want_y.double() * alpha.double()) ** 2).float()
        out[f"bias={bias_on},residual={res_on}"] = {
            "z": (buf[:, 3:] - want_z).abs().max().item(), "pad": bool((buf[:, :3] == 7).all()),
            "y": (y - want_y).abs().max().item() if res_on else 0.0}
model = load_component("code2wav", sys.argv[1], "cpu", torch.float32, "random", 0).requires_grad_(False)
codes = torch.randint(0, model.config.codebook_size, (2, model.config.num_quantizers, 3), generator=gen)
with torch.no_grad():
    ref, wav = model(codes), NativeCode2Wav(model)(codes)
out["decoder_rel"] = ((wav - ref).norm() / ref.norm()).item()
json.dump(out, sys.stdout)
"""


def test_snake_rows_kernel_in_the_interpreter(tiny_model):
    """The Triton kernel (what a GPU runs) against the arithmetic it replaces, each of its variants, and the
    whole native decoder through it against transformers."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("decoder_rel") < 1e-5
    assert len(out) == 4
    for name, r in out.items():
        assert r["z"] < 1e-5 and r["y"] < 1e-5 and r["pad"], (name, r)


def test_the_native_talker_decodes_with_the_native_code2wav_and_the_reference_one_with_transformers(tiny_model):
    """Each engine's code2wav: the native talker's our decoder over transformers' module, the reference talker's
    transformers' own, both 1920 samples a frame."""
    from references import model_config, native_talker
    from services.runtime.config import TalkerConfig
    from services.talker.reference import ReferenceTalker

    native, reference = native_talker(tiny_model), ReferenceTalker(model_config(tiny_model), TalkerConfig())
    assert isinstance(native.code2wav, NativeCode2Wav) and not isinstance(reference.code2wav, NativeCode2Wav)
    assert native.samples_per_frame == reference.samples_per_frame == 1920
