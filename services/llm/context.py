"""What the layers of one forward need to know about the step: set before the forward, cleared after."""

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Context:
    attention: object = None  # a planned attention backend (services/llm/attention.py)
    moe_backend: str = "loop"  # services/llm/moe.py


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


@contextmanager
def step_context(attention, moe_backend: str):
    global _CONTEXT
    _CONTEXT = Context(attention, moe_backend)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = Context()
