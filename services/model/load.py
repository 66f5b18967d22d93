"""Builds one component of a Qwen3-Omni checkpoint (thinker LM, towers, talker, code2wav) from its folder.

Only the tensors a stage needs are read; per-expert and fused expert layouts load, and block-fp8 checkpoints
(dequantised, or their experts as stored: `read_fp8_experts`). Loading is strict: an uncovered parameter is an
error, never a silent random init. `load_format="random"` reads no file: seeded weights drawn on the device."""

import json
import math
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from services.model.spec import FULL_CONFIG_PATH


class ThinkerLM(nn.Module):
    """The thinker's language model alone: decoder stack and lm_head, without the towers."""

    def __init__(self, thinker_config):
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

        text = thinker_config.text_config
        self.model = Qwen3OmniMoeThinkerTextModel._from_config(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


def _modules():
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    return m


@dataclass(frozen=True)
class Component:
    prefix: str
    build: Callable


COMPONENTS: dict[str, Component] = {
    "thinker": Component("thinker.", lambda c: ThinkerLM(c.thinker_config)),
    "vision": Component("thinker.visual.", lambda c: _modules().Qwen3OmniMoeVisionEncoder._from_config(c.thinker_config.vision_config)),
    "audio": Component("thinker.audio_tower.", lambda c: _modules().Qwen3OmniMoeAudioEncoder._from_config(c.thinker_config.audio_config)),
    "talker": Component("talker.", lambda c: _modules().Qwen3OmniMoeTalkerForConditionalGeneration._from_config(c.talker_config)),
    "code2wav": Component("code2wav.", lambda c: _modules().Qwen3OmniMoeCode2Wav._from_config(c.code2wav_config)),
}

_PER_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def load_config(model_dir: str | Path | None):
    """The checkpoint's config; the full-size config when no folder is given."""
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeConfig

    path = Path(model_dir) / "config.json" if model_dir else FULL_CONFIG_PATH
    config = Qwen3OmniMoeConfig(**json.loads(path.read_text()))
    # transformers' talker reads the audio settings from its own config (MODEL.md)
    config.talker_config.audio_config = config.thinker_config.audio_config
    return config


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config names


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_component(name: str, config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The module of a component with placeholder weights, built directly on `device` in `dtype`."""
    with torch.device(device), default_dtype(dtype):
        module = COMPONENTS[name].build(config)
    return module.to(device=device, dtype=dtype).eval()


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights -> transformers' fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for key, t in tensors.items():
        m = _PER_EXPERT.match(key)
        if m:
            groups[m["base"]][m["proj"]][int(m["e"])] = t
        else:
            out[key] = t
    for base, projs in groups.items():
        n = len(projs["down_proj"])
        if any(sorted(projs[p]) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{base}: expert tensors are incomplete")
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(n)]
        out[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


FP8_SCALE = ".weight_scale_inv"  # beside an e4m3 `X.weight`, a float32 scale per tile


def checkpoint_fp8_block(model_dir: str | Path | None) -> int | None:
    """The tile size of a block-scaled fp8 checkpoint (`quantization_config`), or None."""
    if model_dir is None or not (Path(model_dir) / "config.json").exists():
        return None
    qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return None
    size = qc.get("weight_block_size") or []
    if len(size) != 2 or size[0] != size[1]:
        raise ValueError(f"{model_dir}: fp8 checkpoint with weight_block_size {size}: square tiles expected")
    return int(size[0])


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] (e4m3) times its tile scales [ceil(N/b), ceil(K/b)] (edge tiles partial) -> [N, K] in `dtype`."""
    n, k = q.shape
    if scale.shape != (math.ceil(n / block), math.ceil(k / block)):
        raise ValueError(f"scales {tuple(scale.shape)} do not tile a {n} x {k} weight in {block} x {block}")
    full = scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (q.float() * full).to(dtype)


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Every fp8 weight with its tile scales replaced by its float32 value; the scales dropped."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(FP8_SCALE):
            continue
        scale = tensors.get(key.removesuffix(".weight") + FP8_SCALE) if key.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise ValueError(f"{key} is fp8 without {FP8_SCALE}: not a layout this loader knows")
            t = dequantize_tiles(t, scale, block)
        out[key] = t
    return out


def read_fp8_experts(model_dir: str | Path, name: str, block: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """A block-fp8 checkpoint's experts as stored, by module: (gate_up [E, 2I, H], scales, down [E, H, I], scales)."""
    tensors = read_tensors(model_dir, COMPONENTS[name].prefix, lambda k: ".experts." in k)
    groups: dict[str, dict[str, dict[int, tuple]]] = defaultdict(lambda: defaultdict(dict))
    for key, q in tensors.items():
        m = _PER_EXPERT.match(key)
        if m and q.dtype == torch.float8_e4m3fn:
            scale = tensors[key.removesuffix(".weight") + FP8_SCALE]
            if q.shape[0] % block or q.shape[1] % block:
                raise ValueError(f"{key}: {tuple(q.shape)} is not whole {block} x {block} tiles")
            groups[m["base"]][m["proj"]][int(m["e"])] = (q, scale.float())
    out = {}
    for base, projs in groups.items():
        n = len(projs["down_proj"])
        if any(sorted(projs[p]) != list(range(n)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{base}: fp8 expert tensors are incomplete")
        gate_up = torch.stack([torch.cat([projs["gate_proj"][e][0], projs["up_proj"][e][0]]) for e in range(n)])
        gate_up_scale = torch.stack([torch.cat([projs["gate_proj"][e][1], projs["up_proj"][e][1]]) for e in range(n)])
        down = torch.stack([projs["down_proj"][e][0] for e in range(n)])
        down_scale = torch.stack([projs["down_proj"][e][1] for e in range(n)])
        out[base] = (gate_up, gate_up_scale, down, down_scale)
    return out


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    return files


def read_tensors(model_dir: str | Path, prefix: str, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Tensors under `prefix` (stripped) that `wanted` accepts, from every shard of the checkpoint."""
    from safetensors import safe_open

    out = {}
    for path in _shard_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix) and wanted(key[len(prefix):]):
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out


def load_component(
    name: str, model_dir: str | Path | None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    load_format: str = "auto", seed: int = 0,
) -> nn.Module:
    """A component ready to run: from the checkpoint folder, or seeded random weights (`load_format="random"`)."""
    module = build_component(name, load_config(model_dir), device, dtype)
    return load_weights_(module, name, model_dir, dtype, load_format, seed)


def load_weights_(module: nn.Module, name: str, model_dir: str | Path | None, dtype: torch.dtype = torch.float32,
                  load_format: str = "auto", seed: int = 0) -> nn.Module:
    """Fills any module whose parameters are named like component `name`'s (ours or transformers')."""
    if load_format == "random":
        init_weights_(module, component_seed(seed, name), conv_gain=0.6 if name == "code2wav" else 1.0,
                      lm=name in ("thinker", "talker"))
        return module
    children = {n for n, _ in module.named_children()} | {n for n, _ in module.named_parameters(recurse=False)}
    tensors = read_tensors(model_dir, COMPONENTS[name].prefix, lambda k: k.split(".", 1)[0] in children)
    if block := checkpoint_fp8_block(model_dir):  # fp8 experts may read them as stored instead
        tensors = dequantize_checkpoint(tensors, block)
    state = fuse_experts(tensors)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{name}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, t in state.items():
        if t.shape != expected[key].shape:
            raise ValueError(f"{name}: {key} has shape {tuple(t.shape)}, model expects {tuple(expected[key].shape)}")
    module.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return module


def component_seed(seed: int, name: str) -> int:
    return seed * 1000 + sorted(COMPONENTS).index(name)


@torch.no_grad()
def init_full_model_(model: nn.Module, seed: int) -> None:
    """Gives a whole transformers Qwen3-Omni the random weights each component gets, so baseline and stages agree."""
    init_weights_(model.thinker, component_seed(seed, "thinker"), skip=("visual.", "audio_tower."), lm=True)
    init_weights_(model.thinker.visual, component_seed(seed, "vision"))
    init_weights_(model.thinker.audio_tower, component_seed(seed, "audio"))
    if getattr(model, "has_talker", False):
        init_weights_(model.talker, component_seed(seed, "talker"), lm=True)
        init_weights_(model.code2wav, component_seed(seed, "code2wav"), conv_gain=0.6)


# Projections back into the residual stream of decoder layer `i`, scaled in random weights (init_weights_)
_RESIDUAL_OUT = re.compile(r"^(?P<stack>(.*\.)?layers)\.(?P<i>\d+)\.(self_attn\.o_proj\.weight|mlp\.(experts\.)?down_proj(\.weight)?"
                           r"|mlp\.shared_expert\.down_proj\.weight)$")


def _residual_scales(names: list[str]) -> dict[str, float]:
    layers: dict[str, int] = defaultdict(int)
    matches = {n: m for n in names if (m := _RESIDUAL_OUT.match(n))}
    for m in matches.values():
        layers[m["stack"]] = max(layers[m["stack"]], int(m["i"]) + 1)
    return {n: 1 / math.sqrt(2 * layers[m["stack"]]) for n, m in matches.items()}


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int, conv_gain: float = 1.0, skip: tuple[str, ...] = (),
                  lm: bool = False) -> None:
    """Draws every parameter from one seeded generator on the module's device, in name order: norms near 1, biases
    near 0, the rest ~ N(0, 1/fan_in), convolutions scaled by `conv_gain`.

    `lm`: embeddings ~ N(0, 1) and residual output projections scaled by 1 / sqrt(2 x layers), as for training.
    Otherwise embeddings are small beside attention's average, similar prompts choose the same few experts, and a
    benchmark reads far fewer expert weights than real weights make it read.
    """
    params = sorted(((n, p) for n, p in module.named_parameters() if not n.startswith(skip)), key=lambda kv: kv[0])
    residual = _residual_scales([n for n, _ in params]) if lm else {}
    device = params[0][1].device
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    for name, p in params:
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf in ("weight", "gamma"):  # not all 1: a test then sees norms swapped
            p.copy_(1.0 + 0.1 * randn(p.shape))
        elif leaf in ("bias", "beta"):
            p.copy_(randn(p.shape) * 0.02)
        elif leaf == "scale":
            p.fill_(0.1)
        elif lm and name.endswith("embed_tokens.weight"):
            p.copy_(randn(p.shape))
        else:
            is_conv = p.dim() == 3 and "experts" not in name
            fan_in = p[0].numel() if is_conv else p.shape[-1]
            p.copy_(randn(p.shape) * (conv_gain if is_conv else 1.0) * residual.get(name, 1.0) / math.sqrt(fan_in))
