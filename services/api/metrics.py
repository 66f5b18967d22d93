"""The api process's Prometheus metrics (beside prometheus_client's process collector, as every stage has), counted
by an ASGI middleware around the whole app: a streamed reply counts until its last byte."""

import time

from prometheus_client import Counter, Gauge, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("omni_http_requests", "HTTP requests answered, by route and status", ["route", "status"])
LATENCY = Histogram("omni_http_request_seconds", "HTTP request to its reply's last byte", ["route"], buckets=_BUCKETS)
INFLIGHT = Gauge("omni_http_inflight_requests", "HTTP requests being answered", ["route"])
AUDIO_BYTES = Counter("omni_http_audio_bytes", "Audio bytes sent (encoded, before base64), by format", ["format"])

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/audio/speech")


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"  # bounded label values


class Metrics:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, t0, status = route_of(scope["path"]), time.perf_counter(), [499]  # never answered: the client left

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        INFLIGHT.labels(route).inc()
        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if status[0] == 499:
                status[0] = 500
            raise
        finally:
            INFLIGHT.labels(route).dec()
            LATENCY.labels(route).observe(time.perf_counter() - t0)
            REQUESTS.labels(route, str(status[0])).inc()
