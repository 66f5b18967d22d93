"""Four minutes of mixed traffic (bench/soak.py) on a CPU mesh of its own: every request answered as it should be, and
no stage's memory, open files or shared memory growing."""

import pytest

from bench import soak
from conftest import _running_mesh

MB = 1 << 20


@pytest.fixture(scope="module")
def soaked(tiny_model, tmp_path_factory):
    mesh = _running_mesh(tmp_path_factory.mktemp("soak"), tiny_model, encoders=1)
    try:
        result = soak.run(mesh.gateway_address, {n: p.pid for n, p in mesh.procs.items()}, seconds=240, clients=4)
    finally:
        codes = mesh.stop()
    assert all(c == 0 for c in codes.values()), codes
    return result


def test_every_request_answered_as_asked(soaked):
    assert not soaked.failures, soaked.failures[:5]
    assert all(n >= 3 for n in soaked.ok.values()), soaked.ok  # every kind ran, several times


def test_nothing_grows(soaked):
    # A stage's RSS steps up as first-seen batch shapes allocate, rarer as the run goes: three minutes after the
    # first leave one late step of 2 MB under the bound
    slopes = soak.slopes(soaked, warmup_s=60)
    grows = {k: v for k, v in slopes.items() if (k.startswith("fds") and v > 1) or (not k.startswith("fds") and v > MB)}
    assert not grows, {k: f"{v / MB:+.2f} MB/min" if not k.startswith("fds") else f"{v:+.1f}/min" for k, v in grows.items()}
    assert len(slopes) == 1 + 2 * 5  # shm, and rss and fds of each of the five stage processes
