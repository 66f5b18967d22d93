"""The one typed configuration of a mesh, shared by every process of it, validated when loaded."""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from services.runtime.api_config import ApiConfig
from services.runtime.stage_config import (
    EncoderConfig, GatewayConfig, PreprocessConfig, Replica, TalkerConfig, ThinkerConfig)

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ModelConfig:
    path: str = ""
    load_format: Literal["auto", "random"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    name: str = "qwen3-omni"

    @property
    def dir(self) -> Path | None:
        if not self.path:
            return None
        p = Path(self.path)
        return p if p.is_absolute() else REPO_ROOT / p


@dataclass
class Limits:
    max_request_bytes: int = 64 << 20
    max_media_items: int = 16
    max_image_pixels: int = 12_845_056
    max_audio_seconds: float = 600.0
    max_video_frames: int = 128
    max_new_tokens: int = 8192
    max_talker_frames: int = 8192
    # 0: the model's own maximum.
    max_context_tokens: int = 0


@dataclass
class TransportConfig:
    # Share tensors through /dev/shm between processes of one host; off: always inline bytes.
    shm: bool = True
    pool_bytes: int = 256 << 20
    max_slots: int = 4096
    # A slot its consumer never released is reclaimed after this long.
    reclaim_after_s: float = 60.0
    # Between GPU processes of one host, GPU tensors move through CUDA IPC pools of this size (one per GPU).
    cuda_ipc: bool = True
    cuda_pool_bytes: int = 1 << 30
    # A tensor of 8 MB or more read from another GPU is copied in this many parts at once, each on its own
    # streams (bench.transport --read-lanes measures it).
    read_lanes: int = 1
    # How a GPU reads a pool on another GPU: "source", PyTorch's copy between GPUs (launched on the producer's
    # GPU: this process keeps a context there, time-sliced with the producer's), or "pull", the pool mapped
    # into the reading GPU's context and copied by that GPU (bench.transport --cross-gpu-read measures both).
    cross_gpu_read: Literal["source", "pull"] = "source"
    # A GPU put returns once its copy is queued, not done: the ref carries an interprocess CUDA event recorded
    # after the copy, and the consumer's copy waits for it on the device (off: the put waits on the host).
    ipc_events: bool = False
    # A tensor in host memory of at most this many bytes goes inside the message (a speech request's states
    # for one token, 8 KB), not through a shared-memory slot: no slot to take, write, read and give back.
    inline_bytes: int = 16384


@dataclass
class MeshConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    limits: Limits = field(default_factory=Limits)
    transport: TransportConfig = field(default_factory=TransportConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    thinker: ThinkerConfig = field(default_factory=ThinkerConfig)
    talker: TalkerConfig = field(default_factory=TalkerConfig)
    api: ApiConfig = field(default_factory=ApiConfig)

    STAGES: typing.ClassVar = ("gateway", "preprocess", "encoder", "thinker", "talker", "api")
    # Stages that serve HTTP, not gRPC: their health is GET /health.
    HTTP_STAGES: typing.ClassVar = ("api",)

    def replicas(self, stage: str) -> list[Replica]:
        return getattr(self, stage).replicas

    def validate(self) -> "MeshConfig":
        for stage in ("gateway", "preprocess", "encoder", "thinker"):
            if not self.replicas(stage):
                raise ConfigError(f"{stage}: at least one replica is required")
        seen: dict[tuple[str, int], str] = {}
        for stage in self.STAGES:
            for i, r in enumerate(self.replicas(stage)):
                for port in (r.port, r.metrics_port):
                    if not 0 < port < 65536:
                        raise ConfigError(f"{stage}.replicas[{i}]: port {port} out of range")
                    if (r.host, port) in seen:
                        raise ConfigError(f"{stage}.replicas[{i}]: {r.host}:{port} already used by {seen[r.host, port]}")
                    seen[r.host, port] = f"{stage}.replicas[{i}]"
        for stage in ("encoder", "thinker", "talker"):
            if not getattr(self, stage).switch_interval_ms > 0:
                raise ConfigError(f"{stage}.switch_interval_ms must be positive")
        for stage in ("thinker", "talker"):
            if getattr(self, stage).fp8_activations and getattr(self, stage).fp8_experts == "off":
                raise ConfigError(f"{stage}.fp8_activations needs fp8 experts ({stage}.fp8_experts: channel or block)")
            if getattr(self, stage).fp8_fused_quant and not getattr(self, stage).fp8_activations:
                raise ConfigError(f"{stage}.fp8_fused_quant quantises the experts' fp8 activations: it needs "
                                  f"{stage}.fp8_activations")
            if getattr(self, stage).decode_split_kv_max_batch >= 0 and not getattr(self, stage).decode_tensor_cores:
                raise ConfigError(f"{stage}.decode_split_kv_max_batch needs {stage}.decode_tensor_cores (flashinfer's "
                                  "CUDA-core decode kernel is planned its own way)")
        if self.thinker.decode_graph_copies < 1:
            raise ConfigError(f"thinker.decode_graph_copies must be at least 1, not {self.thinker.decode_graph_copies}")
        if self.talker.code2wav_native and self.talker.code2wav_fuse:
            raise ConfigError("talker.code2wav_native fuses code2wav's activations itself: leave talker.code2wav_fuse off")
        if self.encoder.graphs and self.encoder.attention != "varlen":
            raise ConfigError("encoder.graphs needs encoder.attention: varlen (sdpa reads lengths back every layer)")
        if any(not k for k in self.api.keys):
            raise ConfigError("api.keys: an empty key would let any client in")
        if self.model.load_format == "auto" and not self.model.path:
            raise ConfigError("model.path is required unless model.load_format is 'random'")
        return self


class ConfigError(ValueError):
    pass


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        names = {f.name: f for f in dataclasses.fields(tp)}
        unknown = set(value) - set(names)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
        hints = typing.get_type_hints(tp)
        return tp(**{k: _coerce(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        if isinstance(value, bool) and ("off" if value is False else "on") in typing.get_args(tp):
            value = "off" if value is False else "on"  # YAML reads a bare off / on as a bool
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(option, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def apply_overrides(data: dict, overrides: list[str] = ()) -> dict:
    """`section.key=value` overrides (values in YAML) applied to a config's mapping, in place."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(value)
    return data


def read_overridden(path: str | Path, overrides: list[str] = ()) -> dict:
    """The mapping of the config file at `path` with `overrides` applied."""
    return apply_overrides(yaml.safe_load(Path(path).read_text()) or {}, overrides)


def write_overridden(path: str | Path, overrides: list[str], out: str | Path) -> Path:
    """The config at `path` with `overrides` applied, written to `out` (for processes that read their config
    from a file: the stages of a launched mesh). Without overrides, `path` itself."""
    if not overrides:
        return Path(path)
    data = read_overridden(path, overrides)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data))
    return out


def load_config(path: str | Path, overrides: list[str] = ()) -> MeshConfig:
    """The config at `path`, with `section.key=value` overrides (values in YAML) applied on top."""
    return _coerce(MeshConfig, read_overridden(path, overrides), Path(path).name).validate()
