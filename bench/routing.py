"""The thinker's prompts as the mesh lays them out, and how many experts its decode steps choose: a random model's
tokens route by its random router, so the experts a step reads (its cost) may differ with the prompts it sees."""

import statistics

import torch

from bench.workloads import ascii_prompt
from services.runtime.config import MeshConfig


def chat_prompts(cfg: MeshConfig, seed: int):
    """prompt(i, length): request i's t2t text (bench.workloads' generated ASCII) in the chat template, as the
    gateway lays it out, repeated or cut to `length` tokens: prompts like the mesh's, where random token ids may
    route a random model's tokens differently (what `--routing-stats` shows)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.dir)

    def prompt(i: int, length: int) -> torch.Tensor:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ascii_prompt(seed * 1000 + i, length)}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        return torch.tensor((ids * -(-length // len(ids)))[-length:], dtype=torch.long)  # the template's end kept

    return prompt


def experts_touched(engine, seqs: list, rows: int, steps: int = 4) -> dict | None:
    """How many experts a decode step of `rows` tokens chooses per layer (median and range over layers and
    `steps` more steps, and each layer's median, first layer first): what a step reads of the experts' weights.
    Read from forward hooks, so only steps that run eagerly count (captured decode runs no Python: set
    cuda_graph_max_batch=0); None if none did."""
    from services.llm.fp8 import Fp8Experts
    from services.llm.layers import Experts

    layers = [m for m in engine.model.modules() if isinstance(m, (Experts, Fp8Experts))]
    counts: dict[int, list[int]] = {i: [] for i in range(len(layers))}

    def hook_for(layer: int):
        def hook(module, inputs, output):
            x, ids = inputs[0], inputs[1]
            if x.shape[0] == rows:
                counts[layer].append(ids.unique().numel())  # a device sync: this pass is not timed
        return hook

    handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(layers)]
    try:
        for _ in range(steps):
            engine.step(seqs)
    finally:
        for h in handles:
            h.remove()
    every = [c for per_layer in counts.values() for c in per_layer]
    if not every:
        return None
    return {"median": statistics.median(every), "min": min(every), "max": max(every), "layer_steps": len(every),
            "by_layer": [statistics.median(c) if c else None for c in counts.values()]}
