"""Pure tensor functions a process compiles once it asks (`fuse()`): a layer's many small elementwise kernels
become a few. Each is written plain, the reference the CPU and the tests run."""

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


def compiled(fn: Callable) -> Callable:
    """`fn` compiled as the engines compile: shapes dynamic, rounding as eager's, one variant per kind of shape."""
    import torch._inductor.config as inductor
    import torch.fx.experimental._config as symbolic

    inductor.emulate_precision_casts = True  # round where eager rounds: the same numbers
    # Each size its own symbol: with equal sizes sharing one, a later, wider variant takes over the shapes an earlier
    # one served, and a run's numbers would depend on the shapes that came before it
    symbolic.use_duck_shape = False
    # A variant per model and special row count: past dynamo's default limit a function would run eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=True)


def fuse(enabled: bool = True) -> None:
    """Every fusable function compiled (or plain again)."""
    for f in _FUSABLE:
        if not enabled:
            f.fn = f.plain
        elif f.fn is f.plain:  # once per process
            f.fn = compiled(f.plain)
