"""The facts about a Qwen3-Omni checkpoint that the stages share, read from its config.json."""

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

FULL_CONFIG_PATH = Path(__file__).with_name("qwen3-omni-30b-a3b-instruct.config.json")
# Defaults: the thinker's as Qwen recommends (generation_config.json first), the talker's transformers'
THINKER_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0}
TALKER_SAMPLING = {"temperature": 0.9, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class OmniSpec:
    raw: dict
    generation: dict = field(default_factory=dict)  # the checkpoint's generation_config.json, if any

    @classmethod
    def load(cls, model_dir: str | Path) -> "OmniSpec":
        path = Path(model_dir)
        generation = path / "generation_config.json"
        return cls(json.loads((path / "config.json" if path.is_dir() else path).read_text()),
                   json.loads(generation.read_text()) if path.is_dir() and generation.exists() else {})

    @property
    def thinker_sampling(self) -> dict:
        return {k: self.generation.get(k, v) for k, v in THINKER_SAMPLING.items()}

    @property
    def talker_sampling(self) -> dict:
        return dict(TALKER_SAMPLING)

    @property
    def thinker(self) -> dict:
        return self.raw["thinker_config"]

    @property
    def talker(self) -> dict:
        return self.raw["talker_config"]

    @property
    def has_talker(self) -> bool:
        return bool(self.raw.get("enable_audio_output", True)) and "talker_config" in self.raw

    @cached_property
    def voices(self) -> dict[str, int]:
        return dict(self.talker.get("speaker_id") or {}) if self.has_talker else {}

    @property
    def default_voice(self) -> str:
        return "ethan" if "ethan" in self.voices else next(iter(sorted(self.voices)), "")

    @property
    def n_window(self) -> int:
        return self.thinker["audio_config"]["n_window"]

    @property
    def thinker_hidden(self) -> int:
        return self.thinker["text_config"]["hidden_size"]

    @staticmethod
    def spoken_tokens(frames: int) -> int:
        """Text tokens the talker has read once it has made `frames` frames of speech: one a frame (the first rides
        in its prompt), so what was said is the text up to there."""
        return frames

    @property
    def max_positions(self) -> int:
        return self.thinker["text_config"]["max_position_embeddings"]


def audio_tokens(feature_length: int, n_window: int = 50) -> int:
    """Tokens the audio tower makes of `feature_length` mel frames (100 per second): 1 s -> 13."""
    chunk = n_window * 2
    rest = feature_length % chunk
    feat = (rest - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (feature_length // chunk) * 13
