"""Speech in streaming chunks: how frames are cut (chunk_plan), what a decode falls short of (decoded_tail), and a
group of chunks launched through code2wav (Vocoding)."""

import itertools
from dataclasses import dataclass

import torch

from services.talker.seq import TalkerSeq

LEFT_CONTEXT = 25  # frames of left context each chunk is decoded with, as transformers' chunked_decode


def chunk_plan(chunks: list[int], context: int) -> list[tuple[int, int]]:
    """A request's chunks until they repeat, as (frames code2wav sees, new frames): `chunks`, then the last again."""
    plan, start = [], 0
    for i in itertools.count():
        n = chunks[min(i, len(chunks) - 1)]
        plan.append((min(context, start) + n, n))
        if start >= context and i >= len(chunks) - 1:
            return plan
        start += n


def decoded_tail(code2wav) -> int:
    """Samples F frames' decode falls short by: each upsampler trims the r outputs that would read past the end."""
    tail = 0
    for block in code2wav.decoder[1:-2]:
        up = block.block[1]
        tail = tail * up.conv.stride[0] + up.right_pad
    return tail


@dataclass(eq=False)
class Vocoding:
    """code2wav launched for chunks of one length and context; `pcm` is on the host once `end` is reached."""
    chunks: list[tuple[TalkerSeq, int, int]]  # (request, first frame, end frame)
    pcm: torch.Tensor  # [B, samples] float32, pinned
    begin: object  # host.mark()s before the work and after the copy out
    end: object
