"""Each stage process's CPU time over a cell, read from the `process_cpu_seconds_total` its metrics endpoint
exports (prometheus_client's process collector), so a cell shows which process ran out of its core: the
gateway handles every message of every request in one Python process, and at 32 streams that may be the limit
before any GPU is."""

import urllib.request

from services.runtime.config import MeshConfig

STAGES = MeshConfig.STAGES


def parse(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None


class StageCpu:
    """The mesh's metrics endpoints; `read()` gives each reachable one's CPU seconds so far."""

    def __init__(self, cfg: MeshConfig, timeout: float = 2.0):
        self.timeout = timeout
        self.urls = {f"{stage}-{i}": f"http://{r.host}:{r.metrics_port}/metrics"
                     for stage in STAGES for i, r in enumerate(cfg.replicas(stage)) if r.metrics_port}

    def read(self) -> dict[str, float]:
        seconds = {}
        for name, url in list(self.urls.items()):
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                    value = parse(resp.read().decode())
            except OSError:  # not reachable from here (another host's name), or busy past the timeout: left out this time
                continue
            if value is None:  # no process collector (not Linux): not asked again
                del self.urls[name]
            else:
                seconds[name] = value
        return seconds


def fractions(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """CPU seconds per wall second (1.0: one core busy the whole time) of each process read both times."""
    return {k: round((after[k] - before[k]) / max(seconds, 1e-9), 3) for k in after if k in before}
