"""Asks a stage for its gRPC health (or, with --http, an HTTP stage for GET /health): exit 0 when it serves, 1
otherwise (container health checks).

    python -m services.runtime.probe HOST:PORT [--service NAME] [--timeout S] [--http] [--config FILE]
"""

import argparse
import ssl
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.config import MeshConfig, SecurityConfig, load_config
from services.runtime.security import CA, channel


def is_serving(address: str, service: str = "", timeout: float = 2.0, security: SecurityConfig | None = None) -> bool:
    try:
        with channel(security or SecurityConfig(), address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def is_healthy(address: str, timeout: float = 2.0, security: SecurityConfig | None = None) -> bool:
    """An HTTP stage answers GET /health with 200 (the api process: once the gateway behind it answers)."""
    tls = security is not None and security.dir is not None
    context = ssl.create_default_context(cafile=security.dir / CA) if tls else None
    try:
        with urllib.request.urlopen(f"{'https' if tls else 'http'}://{address}/health", timeout=timeout, context=context) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stage_serving(stage: str, address: str, timeout: float = 2.0, security: SecurityConfig | None = None) -> bool:
    if stage in MeshConfig.HTTP_STAGES:
        return is_healthy(address, timeout, security)
    return is_serving(address, timeout=timeout, security=security)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--http", action="store_true", help="an HTTP stage (the api): GET /health")
    parser.add_argument("--config", default=None, help="the mesh config, for its TLS certificates")
    args = parser.parse_args()
    sec = load_config(args.config).security if args.config else None
    ok = is_healthy(args.address, args.timeout, sec) if args.http else is_serving(args.address, args.service, args.timeout, sec)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
