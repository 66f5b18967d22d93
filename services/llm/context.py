"""What the layers of one forward need to know about the step: set before the forward, cleared after."""

from contextlib import contextmanager
from dataclasses import dataclass

from services.llm.attention import AttentionBackend


@dataclass
class Context:
    attention: AttentionBackend | None = None  # planned for this step
    moe_backend: str = "loop"  # a key of services.llm.moe.EXPERTS


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


@contextmanager
def step_context(attention: AttentionBackend | None, moe_backend: str):
    global _CONTEXT
    _CONTEXT = Context(attention, moe_backend)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = Context()
