"""The talker's request (TalkerSeq) and what a step hands out for it (TalkerStep, its SpeechChunks)."""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from services.model.positions import Layout
from services.llm.sampling import SamplingParams

# Fixed in transformers, whatever the talker's settings
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


@dataclass
class TalkerSeq:
    request_id: str
    prompt_ids: torch.Tensor  # [L] the thinker's prompt
    layout: Layout
    speaker_id: int
    params: SamplingParams  # max_tokens counts frames
    tts_embeds: torch.Tensor  # [3, H_thinker]: thinker input embeddings of tts bos, eos, pad
    inbox: deque = field(default_factory=deque)  # thinker states as they arrive: (embeds [n, H], hidden [n, H])
    text_ended: bool = False
    # engine state
    text_done: bool = False  # text_ended, seen after every state sent before it
    done: bool = False
    eos: bool = False
    embeds: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    n_states: int = 0
    cache: DynamicCache | None = None  # the reference engine's
    n_cached: int = 0
    rope_delta: float = 0.0
    code0: int | None = None  # sampled, its frame not yet predicted
    past_hidden: torch.Tensor | None = None  # the reference engine's: talker output at the last position [1, 1, D]
    next_embed: torch.Tensor | None = None  # the native engine's: the last frame's summed code embeddings [D]
    frames_unread: int = 0  # the native engine's: frames launched, codes not read yet
    frames: list[list[int]] = field(default_factory=list)
    decoded: int = 0  # frames launched through code2wav
    vocoding: int = 0  # chunks launched and not yet handed out
    generator: torch.Generator | None = None  # the reference engine's two; the native one hashes seeds
    predictor_generator: torch.Generator | None = None
    predictor_params: SamplingParams | None = None  # None: greedy
    tts: torch.Tensor | None = None  # [3, D] projected tts bos, eos, pad
    seconds: dict = field(default_factory=lambda: {"talker": 0.0, "code_predictor": 0.0, "code2wav": 0.0})
    marks: dict = field(default_factory=lambda: {"arrived": time.perf_counter()})  # milestones to first audio

    def mark(self, milestone: str) -> None:
        self.marks.setdefault(milestone, time.perf_counter())

    def first_audio_split(self) -> dict[str, float]:
        """Seconds between milestones: where a time to first audio went."""
        order = [("talker_wait_states", "arrived", "ready"), ("talker_queue", "ready", "admitted"),
                 ("talker_first_frame", "admitted", "first_frame"), ("talker_first_chunk", "first_frame", "first_audio")]
        return {name: self.marks[b] - self.marks[a] for name, a, b in order if a in self.marks and b in self.marks}


@dataclass
class SpeechChunk:
    pcm: np.ndarray  # float32 mono
    codes: list[list[int]]  # frames x codebooks
    first_frame: int


@dataclass
class TalkerStep:
    chunks: list[SpeechChunk]
    finished: bool = False
