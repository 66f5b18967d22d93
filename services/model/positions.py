"""Multimodal RoPE positions (3 rows: time, height, width) for one prompt, as Qwen3-Omni lays them out.

Text and audio advance all three rows together; an image or video takes its (t, h, w) grid after the text
before it. Generated token i then sits at len(prompt) + i + rope_delta in every row."""

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class MropeTokens:
    image: int
    video: int
    audio: int
    vision_start: int
    audio_start: int
    spatial_merge: int
    position_id_per_seconds: float


@dataclass
class Layout:
    """Sizes of a prompt's media, in prompt order per kind."""
    image_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    video_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    video_second_per_grid: list[float] = field(default_factory=list)
    audio_tokens: list[int] = field(default_factory=list)


F32 = np.float32


def _vision_positions(start: np.float32, grid: tuple[int, int, int], merge: int, t_index: np.ndarray) -> np.ndarray:
    h, w = grid[1] // merge, grid[2] // merge
    tt = np.repeat(t_index.astype(F32), h * w)
    hh = np.tile(np.repeat(np.arange(h, dtype=F32), w), grid[0])
    ww = np.tile(np.arange(w, dtype=F32), grid[0] * h)
    return np.stack([tt, hh, ww]) + start


def mrope_positions(ids: np.ndarray | list[int], layout: Layout, tok: MropeTokens) -> tuple[np.ndarray, float]:
    """-> (positions [3, L] float32, the rope delta); a video at a fractional rate has fractional times."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    if not layout.image_grid_thw and not layout.video_grid_thw:
        return np.broadcast_to(np.arange(n, dtype=np.float32), (3, n)).copy(), 0.0
    # float32 in transformers' order of operations, so fractional positions match bit for bit
    pieces: list[np.ndarray] = []
    next_pos = F32(0)  # max position so far + 1

    def add(block: np.ndarray) -> None:
        nonlocal next_pos
        pieces.append(block)
        if block.size:
            next_pos = block.max() + F32(1)

    def text(count: int) -> None:
        if count > 0:
            add(np.broadcast_to(np.arange(count, dtype=F32) + next_pos, (3, count)))

    image_i = video_i = audio_i = 0
    st = 0
    starts = np.flatnonzero((ids == tok.vision_start) | (ids == tok.audio_start))
    for s in starts:
        if s < st:
            continue
        kind = ids[s + 1] if s + 1 < n else -1
        text(int(s - st) + 1)  # the text before, and the start marker itself
        if ids[s] == tok.audio_start:
            count = layout.audio_tokens[audio_i]
            audio_i += 1
            text(count)
        elif kind == tok.image:
            grid = layout.image_grid_thw[image_i]
            image_i += 1
            count = grid[0] * grid[1] * grid[2] // tok.spatial_merge**2
            t_index = np.arange(grid[0], dtype=np.int64) * int(tok.position_id_per_seconds)
            add(_vision_positions(next_pos, grid, tok.spatial_merge, t_index))
        elif kind == tok.video:
            grid = layout.video_grid_thw[video_i]
            t_index = np.arange(grid[0], dtype=F32) * F32(layout.video_second_per_grid[video_i]) * F32(tok.position_id_per_seconds)
            video_i += 1
            count = grid[0] * grid[1] * grid[2] // tok.spatial_merge**2
            add(_vision_positions(next_pos, grid, tok.spatial_merge, t_index))
        else:
            continue  # a stray start marker is text
        st = int(s) + 1 + count  # the end marker is text
    text(n - st)
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=F32)
    if positions.shape[1] != n:
        raise ValueError(f"positions cover {positions.shape[1]} of {n} tokens: media placeholders and layout disagree")
    delta = float(positions.max() + F32(1) - F32(n)) if n else 0.0
    return positions, delta


def tokens_from_config(cfg: dict) -> MropeTokens:
    """The M-RoPE constants of a thinker or talker config (a dict, as in config.json)."""
    merge = cfg.get("spatial_merge_size") or cfg["vision_config"]["spatial_merge_size"]
    return MropeTokens(
        image=cfg["image_token_id"], video=cfg["video_token_id"], audio=cfg["audio_token_id"],
        vision_start=cfg["vision_start_token_id"], audio_start=cfg["audio_start_token_id"],
        spatial_merge=merge, position_id_per_seconds=cfg["position_id_per_seconds"],
    )
