"""Pure tensor functions that a process compiles once it asks (`fuse()`): a step's tens of small elementwise
kernels a layer become a few. Each is written plain, the reference the CPU and the tests run as it is."""

from typing import Callable

import torch

_FUSABLE: list["fusable"] = []


class fusable:
    """A function, plain until `fuse()` swaps in its compiled version (shapes dynamic: one compile for all)."""

    def __init__(self, fn: Callable):
        self.plain = self.fn = fn
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__
        _FUSABLE.append(self)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def fuse(enabled: bool = True) -> None:
    """Every fusable function compiled (or plain again). Attention kernels and the KV writes stay outside."""
    import torch._inductor.config as inductor

    inductor.emulate_precision_casts = True  # round where eager rounds (to bf16 between ops): the same numbers
    # One variant per model (thinker, talker, predictor: their sizes are constants) and per special row count: past
    # dynamo's default of 8 variants a function would run eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for f in _FUSABLE:
        if not enabled:
            f.fn = f.plain
        elif f.fn is f.plain:  # compiled once per process, whatever engines it builds
            f.fn = torch.compile(f.plain, dynamic=True)
