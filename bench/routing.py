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


def main(argv=None) -> dict:
    """On the CPU: the thinker at full width (hidden 2048, 128 experts, top-8) with `--layers` decoder layers,
    random weights; experts a decode step of `--batch` requests chooses per layer, with random-id prompts and
    with the t2t workload's chat prompts."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from bench import results
    from bench.stages import THINKER_SAMPLING
    from services.llm.sampling import SamplingParams
    from services.model.build import build_full_skeleton
    from services.runtime.config import ModelConfig
    from services.thinker.engine import NativeThinker
    from services.thinker.reference import ThinkerSeq

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model_dir = build_full_skeleton(Path(tempfile.mkdtemp()) / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["thinker_config"]["text_config"]["num_hidden_layers"] = args.layers
    (model_dir / "config.json").write_text(json.dumps(config))
    b, n = args.batch, args.prompt_len
    engine = NativeThinker(model_dir, "cpu", torch.bfloat16, "random", 0, kv_blocks=b * (n // 16 + 4) + 8,
                           max_batched_tokens=4096)
    chat, gen = chat_prompts(MeshConfig(model=ModelConfig(path=str(model_dir))), 0), torch.Generator().manual_seed(0)
    result = results.new_result("routing", {"layers": args.layers}, {}, {"args": vars(args)})
    result["machine"] = results.machine()
    for kind in ("random", "chat"):
        seqs = [ThinkerSeq(f"{kind}{i}", torch.randint(0, engine.vocab, (n,), generator=gen) if kind == "random" else chat(i, n),
                           SamplingParams(max_tokens=16, seed=i + 1, **THINKER_SAMPLING)) for i in range(b)]
        for s in seqs:
            engine.add(s)
        while any(not s.generated for s in seqs):
            engine.step(seqs)
        cell = {"prompts": kind, "batch": b, "prompt_len": n, "experts_touched": experts_touched(engine, seqs, b, steps=3),
                "distinct_prompt_tokens": len({int(t) for s in seqs for t in s.prompt_ids})}
        for s in seqs:
            engine.free(s)
        result["cells"].append(cell)
        print(json.dumps(cell), flush=True)
    results.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
