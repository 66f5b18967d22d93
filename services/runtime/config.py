"""The one typed configuration of a mesh, shared by every process of it, validated when loaded.

A config file may name another it `extends:` (a path relative to it); its own keys are merged over that one's,
section by section (lists are replaced, not merged). Every field has a one-line docstring under it; `docs/config.md`
is generated from them (`python -m services.runtime.config_docs`)."""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Replica:
    """One process of a stage."""

    host: str = "127.0.0.1"
    """Address other processes reach it at; it listens there on loopback, on every interface otherwise."""
    port: int = 0
    """gRPC port."""
    metrics_port: int = 0
    """Port of its Prometheus `/metrics`."""
    device: str = "cpu"
    """Where its engine runs: `cpu` or `cuda:N`."""
    prefer_for: list[Literal["text", "audio"]] = field(default_factory=list)
    """Output modalities whose requests the gateway sends here first (encoders and thinkers)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bind_address(self) -> str:
        loopback = self.host in ("127.0.0.1", "localhost", "::1")
        return f"{self.host if loopback else '0.0.0.0'}:{self.port}"


@dataclass
class StageConfig:
    replicas: list[Replica] = field(default_factory=list)
    """The stage's processes."""


@dataclass
class ModelConfig:
    path: str = ""
    """Checkpoint folder (config.json, tokenizer, safetensors), relative to the repository or absolute."""
    load_format: Literal["auto", "random"] = "auto"
    """`random`: seeded random weights made on the device from the folder's config.json (benchmarks), no file read."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Precision of the weights and activations."""
    name: str = "qwen3-omni"
    """The model's name as clients see it."""

    @property
    def dir(self) -> Path | None:
        if not self.path:
            return None
        p = Path(self.path)
        return p if p.is_absolute() else REPO_ROOT / p


@dataclass
class Limits:
    max_request_bytes: int = 64 << 20
    """Largest request the gateway accepts; also of one video file."""
    max_media_items: int = 16
    """Images, clips and videos in one request."""
    max_image_pixels: int = 12_845_056
    """Pixels of one image or video frame, read from its header before it is decoded."""
    max_audio_seconds: float = 600.0
    """Duration of one audio clip or video file."""
    max_video_frames: int = 128
    """Frames of one video: as sent, or as sampled from its file."""
    max_new_tokens: int = 8192
    """Text tokens one request may generate; also its default."""
    max_talker_frames: int = 8192
    """Speech frames (12.5 a second) one request may generate; also its default."""
    max_context_tokens: int = 0
    """Prompt plus generated tokens; 0: the model's own maximum."""


@dataclass
class TransportConfig:
    shm: bool = True
    """Hand tensors between processes of one host by reference (shared memory, CUDA IPC); off: inline bytes."""
    pool_bytes: int = 256 << 20
    """Each process's shared-memory pool (a sparse file: it costs what it holds)."""
    cuda_pool_bytes: int = 1 << 30
    """Each GPU process's CUDA IPC pool, per GPU."""


@dataclass
class SecurityConfig:
    """Who may reach the mesh: TLS on the public ports, mutual TLS between stages, keys on the public APIs."""

    tls_dir: str = ""
    """Folder of `ca.pem`, `mesh.pem` and `mesh-key.pem` (`scripts/dev-certs` makes one): the public ports serve
    TLS and stages accept only peers holding a certificate of that CA; empty: plaintext."""
    keys: list[str] = field(default_factory=list)
    """API keys a client of the gateway or the HTTP door must send as `authorization: Bearer KEY`; empty: none."""
    reflection: bool = True
    """Internal stages serve gRPC reflection (the gateway always does, its API being public)."""

    @property
    def dir(self) -> Path | None:
        if not self.tls_dir:
            return None
        p = Path(self.tls_dir)
        return p if p.is_absolute() else REPO_ROOT / p


@dataclass
class GatewayConfig(StageConfig):
    replicas: list[Replica] = field(default_factory=lambda: [Replica(port=50051, metrics_port=9100)])
    routing: Literal["modality", "least_loaded", "fixed"] = "modality"
    """Encoder and thinker replicas by the request's output modality (`prefer_for`) then load, by load, or by
    modality however busy."""
    session_context_tokens: int = 0
    """Tokens of earlier turns a Converse session keeps; past it the oldest turns are dropped. 0: half the context."""


@dataclass
class PreprocessConfig(StageConfig):
    workers: int = 2
    """Decoder processes per replica."""


@dataclass
class EncoderConfig(StageConfig):
    """The vision and audio towers (the vision tower replays CUDA graphs on a GPU)."""


@dataclass
class EngineConfig(StageConfig):
    """A stage running a language model (the thinker, the talker)."""

    engine: Literal["native", "reference"] = "native"
    """`native`: paged KV cache and continuous batching; `reference`: transformers' modules, one request a forward."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_blocks: int = 0
    """KV cache blocks; 0: as many as the device has room for."""
    max_batched_tokens: int = 2048
    """Tokens one step may take (prompts are chunked to it)."""
    max_seqs: int = 256
    """Sequences one step may take."""
    moe: Literal["auto", "loop", "grouped", "triton"] = "auto"
    """Experts by the reference loop, a grouped GEMM, or Triton kernels for decode-sized steps; auto: triton on a
    GPU, loop elsewhere."""
    attention: Literal["auto", "torch", "flashinfer"] = "auto"
    """Attention kernels; auto: flashinfer where it runs, PyTorch's SDPA elsewhere."""
    cuda_graph_max_batch: int = 64
    """On a GPU, decode steps of up to this many sequences replay CUDA graphs; 0: no graphs."""
    step_graphs: int = 2048
    """Prompt and mixed steps of up to this many tokens run in pieces between attentions (CUDA graphs on a GPU,
    eager elsewhere); 0: whole forwards."""
    overlap: bool = True
    """Launch each decode step before reading the previous one's outputs, hiding the host's work."""


@dataclass
class ThinkerConfig(EngineConfig):
    fp8: Literal["off", "channel", "block"] = "off"
    """Experts in fp8 (e4m3): per output channel with e4m3 activations, or in 128 x 128 tiles (a block-fp8
    checkpoint's own); off: the model's dtype."""


@dataclass
class TalkerConfig(EngineConfig):
    chunks: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 25])
    """Frames of each streamed chunk of speech, in order; the last repeats."""


@dataclass
class ApiConfig(StageConfig):
    """The OpenAI-compatible HTTP door (services/api): `port` serves HTTP, `metrics_port` Prometheus."""

    allow_url_fetch: bool = False
    """Fetch media given as http(s) URLs (bounded by the request size limit); off: such URLs are answered 400."""
    request_timeout_s: float = 600.0
    """A request not finished after this long is cut and answered 504 (its deadline at the gateway); 0: none."""


@dataclass
class MeshConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    limits: Limits = field(default_factory=Limits)
    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    thinker: ThinkerConfig = field(default_factory=ThinkerConfig)
    talker: TalkerConfig = field(default_factory=TalkerConfig)
    api: ApiConfig = field(default_factory=ApiConfig)

    STAGES: typing.ClassVar = ("gateway", "preprocess", "encoder", "thinker", "talker", "api")
    # Stages that serve HTTP, not gRPC: their health is GET /health
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
        for stage in ("thinker", "talker"):
            s = getattr(self, stage)
            if s.block_size < 1 or s.max_batched_tokens < 1 or s.max_seqs < 1 or s.kv_blocks < 0:
                raise ConfigError(f"{stage}: block_size, max_batched_tokens and max_seqs must be positive, kv_blocks >= 0")
        if not self.talker.chunks or min(self.talker.chunks) < 1:
            raise ConfigError(f"talker.chunks must be positive frame counts, not {self.talker.chunks}")
        if self.preprocess.workers < 1:
            raise ConfigError("preprocess.workers must be at least 1")
        g = self.gateway
        if g.session_context_tokens < 0:
            raise ConfigError("gateway: session_context_tokens must be >= 0")
        if any(not k for k in self.security.keys):
            raise ConfigError("security.keys: an empty key would let any client in")
        if self.security.dir is not None:
            missing = [n for n in ("ca.pem", "mesh.pem", "mesh-key.pem") if not (self.security.dir / n).is_file()]
            if missing:
                raise ConfigError(f"security.tls_dir {self.security.tls_dir}: missing {', '.join(missing)} (scripts/dev-certs makes them)")
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
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
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


def _merge(base: dict, over: dict) -> dict:
    """`over`'s keys over `base`'s, mappings merged key by key, anything else (lists too) replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_config(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """The mapping of the config file at `path`, merged over the one it `extends:` (a path relative to it)."""
    path = Path(path).resolve()
    if path in seen:
        raise ConfigError(f"{path.name}: extends itself through {' -> '.join(p.name for p in seen)}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: expected a mapping at the top")
    base = data.pop("extends", None)
    return _merge(read_config(path.parent / base, (*seen, path)), data) if base else data


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
    """The mapping of the config at `path` (its `extends:` resolved) with `overrides` applied."""
    return apply_overrides(read_config(path), overrides)


def write_overridden(path: str | Path, overrides: list[str], out: str | Path) -> Path:
    """The config at `path` with `overrides`, written to `out` for the stages to read; without overrides, `path`."""
    if not overrides:
        return Path(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(read_overridden(path, overrides)))
    return out


def load_config(path: str | Path, overrides: list[str] = ()) -> MeshConfig:
    """The config at `path`, with `section.key=value` overrides (values in YAML) applied on top."""
    return _coerce(MeshConfig, read_overridden(path, overrides), Path(path).name).validate()
