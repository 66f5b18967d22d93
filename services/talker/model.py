"""The talker on the shared layers: MoE decoder (with the shared expert) over codec embeddings, the head
that picks each frame's first code, the projections from thinker states, and the dense code predictor
that picks the frame's other codes. Names follow the checkpoint (`talker.*`), so the loader fills it."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm.layers import DecoderLayer, MRope, RMSNorm


class ResizeMLP(nn.Module):
    """Thinker width -> talker width."""

    def __init__(self, src: int, mid: int, dst: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(src, mid, bias=True)
        self.linear_fc2 = nn.Linear(mid, dst, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Decoder(nn.Module):
    """Layers + final norm over given input embeddings [N, D] at positions [3, N]."""

    def __init__(self, cfg, rope_sections: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = MRope(cfg.head_dim, cfg.rope_parameters["rope_theta"], rope_sections)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`rope`: the rows' (cos, sin) [N, D] already made, in place of `positions` (the code predictor's,
        whose positions are the same every frame)."""
        cos, sin = rope if rope is not None else self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class TalkerDecoder(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg, cfg.rope_parameters["mrope_section"])
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class PredictorDecoder(Decoder):
    def __init__(self, cfg):
        half = cfg.head_dim // 2
        super().__init__(cfg, [half, 0, 0])  # plain 1-D RoPE: its three position rows are equal
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = PredictorDecoder(cfg)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1))


class TalkerModel(nn.Module):
    def __init__(self, talker_config):
        super().__init__()
        self.config = talker_config
        text = talker_config.text_config
        self.model = TalkerDecoder(text)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.code_predictor = CodePredictor(talker_config.code_predictor_config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.codec_embedding
