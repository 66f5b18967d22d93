"""What an engine stage sets up in its process before serving."""

import asyncio
import sys

import grpc
import pytest

from conftest import write_config
from services.runtime.config import ConfigError, load_config


def test_an_engine_stage_shortens_the_interpreters_switch_interval(tiny_model, tmp_path):
    """The encoder stage, built in this process from a config asking for 0.25 ms, runs with it."""
    from services.encoder.server import build

    cfg = load_config(write_config(tmp_path / "mesh.yaml", tiny_model, encoder={"switch_interval_ms": 0.25}))
    before = sys.getswitchinterval()

    async def go() -> float:
        server = grpc.aio.server()
        stage = await build(cfg, 0, server)
        try:
            return sys.getswitchinterval()
        finally:
            await stage.close()

    try:
        assert asyncio.run(go()) == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(before)


def test_a_switch_interval_must_be_positive(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="talker.switch_interval_ms must be positive"):
        load_config(write_config(tmp_path / "mesh.yaml", tiny_model, talker={"switch_interval_ms": 0}))
