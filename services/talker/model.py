"""The talker on the shared layers: a MoE decoder with a shared expert over codec embeddings, the head for each
frame's first code, projections from thinker states, and the dense code predictor for the other codes."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm.fusion import fusable
from services.llm.layers import MLP, Decoder
from services.llm.moe import SparseMoE


class ResizeMLP(nn.Module):
    """Thinker width -> talker width."""

    def __init__(self, src: int, mid: int, dst: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(src, mid, bias=True)
        self.linear_fc2 = nn.Linear(mid, dst, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


@fusable
def shared_combine(routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return routed + torch.sigmoid(gate) * shared


class SharedExpertMoE(SparseMoE):
    """The routed experts plus a shared expert every token goes through, scaled by a sigmoid gate."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        routed = self.routed(x, residual)
        return shared_combine(routed, self.shared_expert_gate(x), self.shared_expert(x))


class TalkerDecoder(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg, cfg.rope_parameters["mrope_section"], SharedExpertMoE)
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
