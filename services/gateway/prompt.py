"""Chat messages -> the thinker's prompt: the checkpoint's chat template, one placeholder token per
media item expanded to as many tokens as the item takes (a video with its sound: both, interleaved as Qwen's
processor interleaves them), and M-RoPE positions."""

import re
from dataclasses import dataclass, field

import numpy as np

from services.model.positions import Layout, audio_in_video_order, mrope_positions, tokens_from_config
from services.model.spec import OmniSpec
from services.runtime.errors import InvalidArgument


@dataclass
class MediaRef:
    kind: str  # "image" | "audio" | "video"
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    feature_length: int = 0
    second_per_grid: float = 0.0
    with_audio: bool = False  # video: the next item is its sound, interleaved with its frames


@dataclass
class Prompt:
    ids: list[int]
    runs: list[list[tuple[int, int]]]  # per media item, in media order: (offset, tokens) of each run it fills
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

    def template(self, messages: list[dict]) -> list[int]:
        """`messages` in chat-template form through the chat template: one placeholder per media part."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return ids if isinstance(ids, list) else list(ids["input_ids"])

    def length(self, ids: list[int], media: list[MediaRef]) -> int:
        """len(build(ids, media).ids), nothing built: each placeholder takes its item's tokens, a video heard its
        soundtrack's too between <|audio_start|> and <|audio_end|>."""
        pads = set(self.pad.values())
        return (sum(1 for t in ids if t not in pads) + sum(m.num_tokens for m in media)
                + 2 * sum(1 for m in media if m.with_audio))

    def build(self, ids: list[int], media: list[MediaRef]) -> Prompt:
        """`ids` from `template`, their placeholders in the order of `media`."""
        pad_to_kind = {v: k for k, v in self.pad.items()}
        out: list[int] = []
        runs: list[list[tuple[int, int]]] = []
        for tok in ids:
            kind = pad_to_kind.get(tok)
            if kind is None:
                out.append(tok)
                continue
            item = media[len(runs)] if len(runs) < len(media) else None
            if item is None or item.kind != kind:
                raise InvalidArgument("the chat template's media placeholders do not match the media given")
            if item.with_audio:
                runs += self._with_audio(out, item, media[len(runs) + 1] if len(runs) + 1 < len(media) else None)
                continue
            runs.append([(len(out), item.num_tokens)])
            out.extend([tok] * item.num_tokens)
        if len(runs) != len(media):
            raise InvalidArgument(f"the chat template placed {len(runs)} media placeholders for {len(media)} media items")
        layout = Layout(
            image_grid_thw=[m.grid_thw for m in media if m.kind == "image"],
            video_grid_thw=[m.grid_thw for m in media if m.kind == "video"],
            video_second_per_grid=[m.second_per_grid for m in media if m.kind == "video"],
            audio_tokens=[m.num_tokens for m in media if m.kind == "audio"],
        )
        positions, delta = mrope_positions(out, layout, self.rope)
        return Prompt(out, runs, positions, delta, layout, [m.feature_length for m in media if m.kind == "audio"])

    def _with_audio(self, out: list[int], video: MediaRef, sound: MediaRef | None) -> list[list[tuple[int, int]]]:
        """Appends a video's frame and audio tokens, interleaved by time, inside <|audio_start|> .. <|audio_end|>
        (after the template's <|vision_start|>) -> the runs of the video's rows, then of its sound's."""
        th = self.spec.thinker
        if sound is None or sound.kind != "audio" or out[-1:] != [th["vision_start_token_id"]]:
            raise InvalidArgument("a video with its sound needs its soundtrack after it, inside its vision markers")
        is_audio = audio_in_video_order(video.grid_thw, video.second_per_grid, sound.num_tokens, self.rope.spatial_merge,
                                        self.rope.position_id_per_seconds)
        out.append(th["audio_start_token_id"])
        base = len(out)
        out.extend(np.where(is_audio, self.pad["audio"], self.pad["video"]).tolist())
        out.append(th["audio_end_token_id"])
        return [_runs(~is_audio, base), _runs(is_audio, base)]


def _runs(mask: np.ndarray, base: int) -> list[tuple[int, int]]:
    """(base + start, length) of each run of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [(base + int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
