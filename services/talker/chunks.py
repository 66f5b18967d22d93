"""Speech in streaming chunks: the chunks a request's frames are cut into (chunk_plan), what a decode of them falls
short of (decoded_tail), and a group of chunks launched through code2wav (Vocoding)."""

import itertools
from dataclasses import dataclass

import torch

from services.talker.seq import TalkerSeq

LEFT_CONTEXT = 25  # frames of left context each chunk is decoded with, as transformers' chunked_decode


def chunk_plan(chunks: list[int], context: int) -> list[tuple[int, int]]:
    """The streaming chunks of a request until they repeat, as (frames code2wav sees: left context included, new
    frames): `chunks` in order, then the last one again; the left context is every frame before the chunk, up to
    `context`."""
    plan, start = [], 0
    for i in itertools.count():
        n = chunks[min(i, len(chunks) - 1)]
        plan.append((min(context, start) + n, n))
        if start >= context and i >= len(chunks) - 1:
            return plan
        start += n


def decoded_tail(code2wav) -> int:
    """How many samples a decode of F frames falls short of F frames' worth: each of the decoder's upsamplers (a
    transposed convolution of stride r trimming r outputs at each end, whose last r would read the row after the
    last) drops r of its outputs, each as many samples as the upsamplers after it multiply it into (555 for
    Qwen3-Omni's rates 8, 5, 4, 3)."""
    tail = 0
    for block in code2wav.decoder[1:-2]:
        up = block.block[1]
        tail = tail * up.conv.stride[0] + up.right_pad
    return tail


@dataclass(eq=False)
class Vocoding:
    """code2wav launched for a group of chunks (one length and left context); its waveforms are in host
    memory once its `end` mark is reached."""
    chunks: list[tuple[TalkerSeq, int, int]]  # (request, first frame, end frame)
    pcm: torch.Tensor  # [B, samples] float32: pinned host memory a side stream copies into, or already there
    begin: object  # marks (services.llm.host.mark) before the work and after the copy out
    end: object
