"""The thinker's language model on the shared layers: MoE decoder layers with DeepStack visual states added
after the first ones, and lm_head. Names follow the checkpoint, so the component loader fills it."""

import torch
from torch import nn

from services.llm.layers import Decoder


class TextModel(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg, cfg.rope_parameters["mrope_section"])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class ThinkerModel(nn.Module):
    def __init__(self, thinker_config):
        super().__init__()
        self.text_config = cfg = thinker_config.text_config
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, deepstack_rows: torch.Tensor | None = None,
                deepstack: list[torch.Tensor] | None = None, capture_layer: int | None = None):
        """embeds [N, H], positions [3, N] -> (normed [N, H], layer `capture_layer`'s output before DeepStack)."""
        cos, sin = self.model.rope(positions, embeds.dtype)
        x, captured = embeds, None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin)
            if capture_layer == i + 1:
                captured = x
            if deepstack is not None and i < len(deepstack):
                x = x.index_add(0, deepstack_rows, deepstack[i].to(x.dtype))
        out = self.model.norm(x)
        return out, (out if capture_layer == len(self.model.layers) else captured)

    def after_layer(self, capture_layer: int | None, deepstack_rows, deepstack, kept: dict):
        """forward's work between layers for a forward in pieces, in place; the capture goes to kept["states"]."""
        def hook(i: int, x: torch.Tensor) -> None:
            if capture_layer == i + 1:
                kept["states"] = x.clone()
            if deepstack is not None and i < len(deepstack):
                x.index_add_(0, deepstack_rows, deepstack[i].to(x.dtype))
        return hook
