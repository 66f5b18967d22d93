"""What the layers of one forward need to know about the step: set before the forward, cleared after."""

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Context:
    attention: object = None  # a planned attention backend (services/llm/attention.py)
    moe_backend: str = "loop"
    triton_linear: bool = False  # steps of few rows project through triton_linear where it takes the weight's shape


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


@contextmanager
def step_context(attention, moe_backend: str, triton_linear: bool = False):
    global _CONTEXT
    _CONTEXT = Context(attention, moe_backend, triton_linear)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = Context()
