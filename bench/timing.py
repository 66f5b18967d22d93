"""Timing a stage bench's cells: wall time with the device drained, and the engine's host time a step by phase."""

import time

import torch

from services.llm.host import laps_per_step


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Wall seconds of fn(), with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def host_split(engine, before: dict | None, steps: int) -> dict:
    """The host's ms a step by phase since `before` (a copy of the engine's laps' seconds; "wait": blocked on the
    device), and the host's own ms a step (every phase but the wait); nothing for an engine without laps."""
    if before is None:
        return {}
    split = laps_per_step(before, engine.laps.seconds, steps)
    return {"host_ms_per_step": sum(v for k, v in split.items() if k != "wait"), "host_split_ms": split}


def laps(engine) -> dict | None:
    return dict(engine.laps.seconds) if getattr(engine, "laps", None) is not None else None
