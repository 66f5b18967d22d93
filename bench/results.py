"""The result file: one JSON per run, the same schema for the sweep (both engines) and the stage benchmarks.

{"schema": 1, "created", "git_commit", "git_dirty", "machine", "engine": "mesh" | "hf" | "stages",
 "config": {"path", "content", ...}, "model": {...}, "run": {...}, "cells": [{...}, ...]}
"""

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = 1
# Fields that say which cell it is (the rest are its figures).
KEY_FIELDS = ("workload", "stage", "mode", "item", "concurrency", "batch", "prompt_len", "client")
# Figures compared across runs, and whether more is better.
METRICS = {
    "output_tok_per_s": True, "req_per_s": True, "audio_s_per_s": True,
    "ttft_p50": False, "ttft_p99": False, "ttfa_p50": False, "ttfa_p99": False, "itl_p50": False,
    "e2e_p50": False, "e2e_p99": False, "rtf_p50": False, "failures": False,
    # stage benchmarks
    "tok_per_s": True, "frames_per_s": True, "items_per_s": True, "step_ms": False, "host_ms_per_step": False,
}
REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


SOURCE_DIRS = ("services", "bench", "configs", "omni", "protos")


def source_digest() -> str:
    """sha256 over the code that ran (tracked and untracked files of the source folders, results excluded):
    a run made from a copied working tree whose git metadata is stale still names its code exactly
    (`python -c "from bench.results import source_digest; print(source_digest())"` on a checkout to match)."""
    files = set((_git("ls-files", *SOURCE_DIRS) or "").splitlines())
    files |= set((_git("ls-files", "--others", "--exclude-standard", *SOURCE_DIRS) or "").splitlines())
    h = hashlib.sha256()
    for name in sorted(f for f in files if f and not f.startswith("bench/results/")):
        path = REPO_ROOT / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def git_state() -> dict:
    return {"git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "source_digest": source_digest()}


def gpus() -> list[dict]:
    """GPU names and memory from nvidia-smi (no CUDA context made in this process); none without it."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"name": n, "memory_gib": round(float(m) / 1024, 1), "driver": d} for n, m, d in rows]


def machine() -> dict:
    import grpc
    import torch
    import transformers

    return {
        "hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "grpcio": grpc.__version__, "gpus": gpus(),
    }


def model_info(model_dir: Path | None, model_cfg) -> dict:
    """The model the run used: the mesh config's model section and the sizes from its config.json."""
    info = {"path": str(model_dir) if model_dir else "", "name": model_cfg.name, "load_format": model_cfg.load_format,
            "dtype": model_cfg.dtype}
    cfg_path = Path(model_dir) / "config.json" if model_dir else None
    if cfg_path and cfg_path.exists():
        raw = json.loads(cfg_path.read_text())
        text = raw["thinker_config"]["text_config"]
        keys = ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "vocab_size")
        info["thinker"] = {k: text.get(k) for k in keys}
        talker = raw.get("talker_config", {}).get("text_config", {})
        info["talker"] = {k: talker.get(k) for k in ("hidden_size", "num_hidden_layers", "num_experts")}
    return info


def new_result(engine: str, config: dict, model: dict, run: dict) -> dict:
    return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **git_state(),
            "machine": {}, "engine": engine, "config": config, "model": model, "run": run, "cells": []}


def write(result: dict, path: str | Path) -> Path:
    """Writes atomically, so a run killed mid-write keeps its previous complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=_plain) + "\n")
    tmp.replace(path)
    return path


def _plain(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read(path: str | Path) -> dict:
    result = json.loads(Path(path).read_text())
    if result.get("schema") != SCHEMA or not isinstance(result.get("cells"), list):
        raise ValueError(f"{path}: not a schema-{SCHEMA} result file")
    return result


def cell_key(cell: dict) -> tuple:
    return tuple((k, cell[k]) for k in KEY_FIELDS if k in cell)


def key_label(key: tuple) -> str:
    names = {"concurrency": "B", "batch": "batch", "prompt_len": "L"}
    return " ".join(f"{names[k]}={v}" if k in names else str(v) for k, v in key)


def ratio(ours, theirs, higher_is_better: bool) -> float | None:
    """How many times better `ours` is (>1: ours better), whichever direction the metric runs."""
    if ours is None or theirs is None:
        return None
    if higher_is_better:
        return ours / theirs if theirs else None
    return theirs / ours if ours else None
