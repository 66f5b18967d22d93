"""Translations between stage messages and the plain objects engines use (servers call these)."""

import torch

from omni.stage.v1 import common_pb2
from services.model.positions import Layout
from services.llm.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def layout_from_proto(msg: common_pb2.MediaLayout, audio_tokens: list[int]) -> Layout:
    def triples(flat):
        return [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]

    return Layout(
        image_grid_thw=triples(list(msg.image_grid_thw)), video_grid_thw=triples(list(msg.video_grid_thw)),
        video_second_per_grid=list(msg.video_second_per_grid), audio_tokens=audio_tokens,
    )


def timings(**seconds: float) -> list[common_pb2.Timing]:
    return [common_pb2.Timing(stage=k, seconds=v) for k, v in seconds.items() if v]
