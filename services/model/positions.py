"""Multimodal RoPE positions (3 rows: time, height, width) for one prompt, as Qwen3-Omni lays them out: transformers'
get_rope_index, step for step.

Text and audio advance all three rows together; an image or video takes its (t, h, w) grid after the text before
it; a video with its sound (use_audio_in_video) is <|vision_start|><|audio_start|>, its frame and audio tokens
interleaved by time, <|audio_end|><|vision_end|>, each token at its own grid or audio position. Generated token i
then sits at len(prompt) + i + rope_delta in every row."""

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
    """Sizes of a prompt's media, in prompt order per kind (a video's sound is an audio item in its place)."""
    image_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    video_grid_thw: list[tuple[int, int, int]] = field(default_factory=list)
    video_second_per_grid: list[float] = field(default_factory=list)
    audio_tokens: list[int] = field(default_factory=list)


F32 = np.float32


def audio_in_video_order(grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int, merge: int,
                         per_second: float) -> np.ndarray:
    """Which tokens of a video with its sound are audio: [frame tokens + audio_tokens] bools in prompt order, as
    Qwen3OmniMoeProcessor interleaves them (in float64): a frame token goes before any audio token at its time."""
    frame_time = np.repeat(np.arange(grid[0]), grid[1] // merge * (grid[2] // merge)) * second_per_grid * per_second
    is_audio = np.zeros(len(frame_time) + audio_tokens, dtype=bool)
    j = np.arange(audio_tokens)
    is_audio[j + np.searchsorted(frame_time, j, side="right")] = True
    return is_audio


def _vision_positions(start: np.float32, grid: tuple[int, int, int], merge: int, t_index: np.ndarray) -> np.ndarray:
    h, w = grid[1] // merge, grid[2] // merge
    tt = np.repeat(t_index.astype(F32), h * w)
    hh = np.tile(np.repeat(np.arange(h, dtype=F32), w), grid[0])
    ww = np.tile(np.arange(w, dtype=F32), grid[0] * h)
    return np.stack([tt, hh, ww]) + start


def _rows(count: int, start: np.float32) -> np.ndarray:
    return np.broadcast_to(np.arange(count, dtype=F32) + start, (3, count))


def _interleaved(video: np.ndarray, audio: np.ndarray) -> list[np.ndarray]:
    """A video's and its sound's positions merged by time row, frame tokens first on a tie, as get_rope_index
    merges them: [all but the last run of one kind, that run], as it appends them."""
    at = np.arange(video.shape[1]) + np.searchsorted(audio[0], video[0], side="left")
    is_video = np.zeros(video.shape[1] + audio.shape[1], dtype=bool)
    is_video[at] = True
    merged = np.empty((3, len(is_video)), dtype=F32)
    merged[:, is_video], merged[:, ~is_video] = video, audio
    change = np.flatnonzero(is_video != is_video[-1])
    tail = change[-1] + 1 if len(change) else 0
    return [merged[:, :tail], merged[:, tail:]] if tail else [merged]


def mrope_positions(ids: np.ndarray | list[int], layout: Layout, tok: MropeTokens,
                    use_audio_in_video: bool | None = None) -> tuple[np.ndarray, float]:
    """-> (positions [3, L] float32, the rope delta); a video at a fractional rate has fractional times.

    `use_audio_in_video`: None lays every video out as its tokens say (what get_rope_index does when its flag agrees
    with the prompt); True or False: get_rope_index's own counts under that flag, which pass over media it does not
    expect (transformers' talker is given no flag: False)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    if not layout.image_grid_thw and not layout.video_grid_thw:
        return np.broadcast_to(np.arange(n, dtype=F32), (3, n)).copy(), 0.0
    try:
        positions = _positions(ids, layout, tok, use_audio_in_video)
    except (IndexError, ValueError):  # a marker with no item, or an item with no marker
        positions = None
    if positions is None or positions.shape[1] != n:
        raise ValueError(f"positions do not cover the {n} tokens: media placeholders and layout disagree")
    delta = float(positions.max() + F32(1) - F32(n)) if n else 0.0
    return positions, delta


def _positions(ids: np.ndarray, layout: Layout, tok: MropeTokens, flag: bool | None) -> np.ndarray:
    # float32 in transformers' order of operations, so fractional positions match bit for bit
    n, tokens = len(ids), ids.tolist()
    starts = np.flatnonzero(ids == tok.vision_start)
    after = ids[np.minimum(starts + 1, n - 1)]
    images, plain, with_sound = (int((after == k).sum()) for k in (tok.image, tok.video, tok.audio_start))
    audios = int((ids == tok.audio_start).sum())
    items = images + audios + (0 if flag else plain)
    left = {"image": images, "video": {None: plain + with_sound, True: with_sound, False: plain}[flag], "audio": audios}
    has_vision, has_audio = tok.image in tokens or tok.video in tokens, tok.audio in tokens
    pieces: list[np.ndarray] = []
    image_i = video_i = audio_i = st = 0

    def next_start() -> np.float32:  # transformers': the last piece's max + 1
        return pieces[-1].max() + F32(1) if pieces else F32(0)

    for _ in range(items):
        st_idx = next_start()
        ed_vision = tokens.index(tok.vision_start, st) if has_vision and (left["video"] > 0 or left["image"] > 0) else n + 1
        ed_audio = tokens.index(tok.audio_start, st) if has_audio and left["audio"] > 0 else n + 1
        first = min(ed_vision, ed_audio)
        text = first - st
        if text:
            pieces.append(_rows(text, st_idx))
            st_idx = st_idx + F32(text)
        in_video = first == ed_vision and ed_vision + 1 == ed_audio
        marks = 2 if in_video else 1  # <|vision_start|><|audio_start|> and the two ends
        pieces.append(_rows(marks, st_idx))
        st_idx = st_idx + F32(marks)
        if first == ed_audio:
            count = layout.audio_tokens[audio_i]
            pieces.append(_rows(count, st_idx))
            audio_i, left["audio"] = audio_i + 1, left["audio"] - 1
        elif ids[first + 1] == tok.image:
            grid = layout.image_grid_thw[image_i]
            count = grid[0] * grid[1] * grid[2] // tok.spatial_merge**2
            t_index = np.arange(grid[0], dtype=np.int64) * int(tok.position_id_per_seconds)
            pieces.append(_vision_positions(st_idx, grid, tok.spatial_merge, t_index))
            image_i, left["image"] = image_i + 1, left["image"] - 1
        elif ids[first + 1] == tok.video or in_video:
            grid = layout.video_grid_thw[video_i]
            t_index = np.arange(grid[0], dtype=F32) * F32(layout.video_second_per_grid[video_i]) * F32(tok.position_id_per_seconds)
            video = _vision_positions(st_idx, grid, tok.spatial_merge, t_index)
            count = video.shape[1]
            if in_video:
                sound = layout.audio_tokens[audio_i]
                pieces += _interleaved(video, _rows(sound, st_idx))
                count += sound
                audio_i, left["audio"] = audio_i + 1, left["audio"] - 1
            else:
                pieces.append(video)
            video_i, left["video"] = video_i + 1, left["video"] - 1
        else:  # get_rope_index would lay out the markers and pass nothing over: positions past the prompt
            raise ValueError("a vision marker before no media")
        st += text + marks + count + marks
        pieces.append(_rows(marks, next_start()))
    if st < n:
        pieces.append(_rows(n - st, next_start()))
    return np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=F32)


def tokens_from_config(cfg: dict) -> MropeTokens:
    """The M-RoPE constants of a thinker or talker config (a dict, as in config.json)."""
    merge = cfg.get("spatial_merge_size") or cfg["vision_config"]["spatial_merge_size"]
    return MropeTokens(
        image=cfg["image_token_id"], video=cfg["video_token_id"], audio=cfg["audio_token_id"],
        vision_start=cfg["vision_start_token_id"], audio_start=cfg["audio_start_token_id"],
        spatial_merge=merge, position_id_per_seconds=cfg["position_id_per_seconds"],
    )
