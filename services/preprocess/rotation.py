"""A video's display orientation, applied as FFmpeg's command line applies it (autorotate): the frame's display
matrix, or a stream's `rotate` tag where it has none, turned into the transpose and flips a player shows."""

import math

import numpy as np
from av.sidedata.sidedata import Type

Matrix = tuple[int, int, int, int, int, int, int, int, int]  # FFmpeg's AV_PKT_DATA_DISPLAYMATRIX, 16.16 fixed point


def display_matrix(frame, tags: dict[str, str]) -> Matrix | None:
    """The frame's display matrix, else one made from the stream's `rotate` tag (degrees clockwise, as FFmpeg read
    it before display matrices), else None."""
    side = frame.side_data.get(Type.DISPLAYMATRIX)
    if side is not None:
        return tuple(np.frombuffer(bytes(side), np.int32).tolist())
    tag = next((v for k, v in tags.items() if k.lower() == "rotate"), None)
    try:
        degrees = float(tag) if tag else 0.0
    except ValueError:
        return None
    if not math.isfinite(degrees) or not degrees % 360:
        return None
    c, s = (round(f(math.radians(-degrees)) * 65536) for f in (math.cos, math.sin))  # av_display_rotation_set
    return c, -s, 0, s, c, 0, 0, 0, 1 << 30


def clockwise(m: Matrix) -> float:
    """The degrees in [0, 360) a player turns the frame clockwise by (fftools' get_rotation)."""
    s0, s1 = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
    if not s0 or not s1:
        return 0.0
    theta = -round(-math.degrees(math.atan2(m[1] / s1, m[0] / s0)))  # av_display_rotation_get is counterclockwise
    return theta - 360 * math.floor(theta / 360 + 0.9 / 360)


def upright(rgb: np.ndarray, m: Matrix | None) -> np.ndarray:
    """A frame [H, W, 3] as displayed: the transpose or flips fftools inserts for its matrix. Angles other than
    right ones (FFmpeg's rotate filter, black corners) are left as stored: no camera writes them."""
    if m is None:
        return rgb
    theta = clockwise(m)
    if abs(theta - 90) < 1:
        return rgb.transpose(1, 0, 2) if m[3] > 0 else np.rot90(rgb, -1)  # transpose=cclock_flip, or clock
    if abs(theta - 180) < 1:
        return rgb[:: -1 if m[4] < 0 else 1, :: -1 if m[0] < 0 else 1]
    if abs(theta - 270) < 1:
        return np.rot90(rgb, -1)[::-1] if m[3] < 0 else np.rot90(rgb, 1)  # transpose=clock_flip, or cclock
    if abs(theta) < 1 and m[4] < 0:
        return rgb[::-1]
    return rgb
