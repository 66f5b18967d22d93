"""Host values for the device, sent without waiting for it.

A copy from pageable host memory may wait for every kernel queued before it (the driver stages it through
pinned memory it may have to synchronise for), which after a graph replay means the whole step: the host
then spends the step blocked where it meant to queue work. From pinned memory the copy is queued behind
those kernels like one more of them. torch's pinned-memory cache keeps each buffer until its copy is done.
"""

import torch


def _host(values, dtype: torch.dtype | None, pin: bool) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        host = values.to(dtype) if dtype is not None else values
        return host.pin_memory() if pin else host
    return torch.tensor(values, dtype=dtype, pin_memory=pin)


def pinned(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` in pinned host memory, for a library that copies them to the device itself without blocking
    (flashinfer's plans): from pageable memory that copy would wait for the device first."""
    return _host(values, dtype, torch.cuda.is_available())


def upload(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (nested lists or a CPU tensor) on `device`, queued without waiting on it."""
    return _host(values, dtype, device.type == "cuda").to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values) -> None:
    """Copies `values` into the device tensor `dst` (same shape), queued without waiting on the device."""
    dst.copy_(_host(values, dst.dtype, dst.device.type == "cuda"), non_blocking=True)


def scalar(value, like: torch.Tensor) -> torch.Tensor:
    """`value` as a 0-dim tensor of `like`'s dtype on its device, made there by a fill. Assigned through an index
    tensor (`x[rows, cols] = value`), a Python number is made in host memory and copied over first, a copy that
    waits for everything queued on the device (a slice assignment fills without one)."""
    return torch.full((), value, dtype=like.dtype, device=like.device)
