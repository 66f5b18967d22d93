"""Chat messages -> the thinker's prompt: the checkpoint's chat template, one placeholder token per
media item expanded to as many tokens as the item takes, and M-RoPE positions."""

import re
from dataclasses import dataclass, field

import numpy as np

from services.model.positions import Layout, mrope_positions, tokens_from_config
from services.model.spec import OmniSpec
from services.runtime.errors import InvalidArgument


@dataclass
class MediaRef:
    kind: str  # "image" | "audio" | "video"
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    feature_length: int = 0
    second_per_grid: float = 0.0


@dataclass
class Prompt:
    ids: list[int]
    offsets: list[int]  # where each media item's tokens start, in media order
    positions: np.ndarray  # [3, L] float32
    rope_delta: float
    layout: Layout
    audio_feature_lengths: list[int] = field(default_factory=list)


class PromptBuilder:
    def __init__(self, model_dir, spec: OmniSpec):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.spec = spec
        th = spec.thinker
        self.pad = {"image": th["image_token_id"], "audio": th["audio_token_id"], "video": th["video_token_id"]}
        self.rope = tokens_from_config(th)
        reserved = [t for t in self.tokenizer.all_special_tokens if t] + list(self.tokenizer.get_added_vocab())
        # One pass over the text for all of them, longest first, not one pass per token
        self.reserved = re.compile("|".join(re.escape(t) for t in sorted(set(reserved), key=len, reverse=True)))

    def check_text(self, text: str, where: str) -> None:
        if found := self.reserved.search(text):
            raise InvalidArgument(f"{where}: text contains the reserved token {found.group(0)}")

    def build(self, messages: list[dict], media: list[MediaRef]) -> Prompt:
        """`messages` in chat-template form, their media parts in the order of `media`."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        pad_to_kind = {v: k for k, v in self.pad.items()}
        out: list[int] = []
        offsets: list[int] = []
        for tok in ids:
            kind = pad_to_kind.get(tok)
            if kind is None:
                out.append(tok)
                continue
            if len(offsets) >= len(media) or media[len(offsets)].kind != kind:
                raise InvalidArgument("the chat template's media placeholders do not match the media given")
            offsets.append(len(out))
            out.extend([tok] * media[len(offsets) - 1].num_tokens)
        if len(offsets) != len(media):
            raise InvalidArgument(f"the chat template placed {len(offsets)} media placeholders for {len(media)} media items")
        layout = Layout(
            image_grid_thw=[m.grid_thw for m in media if m.kind == "image"],
            video_grid_thw=[m.grid_thw for m in media if m.kind == "video"],
            video_second_per_grid=[m.second_per_grid for m in media if m.kind == "video"],
            audio_tokens=[m.num_tokens for m in media if m.kind == "audio"],
        )
        positions, delta = mrope_positions(out, layout, self.rope)
        return Prompt(out, offsets, positions, delta, layout, [m.feature_length for m in media if m.kind == "audio"])
