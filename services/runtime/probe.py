"""Asks a stage for its gRPC health (or, with --http, an HTTP stage for GET /health): exit 0 when it serves, 1
otherwise (container health checks).

    python -m services.runtime.probe HOST:PORT [--service NAME] [--timeout S] [--http]
"""

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout: float = 2.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def is_healthy(address: str, timeout: float = 2.0) -> bool:
    """An HTTP stage answers GET /health with 200 (the api process: once the gateway behind it answers)."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stage_serving(stage: str, address: str, timeout: float = 2.0) -> bool:
    from services.runtime.config import MeshConfig

    return is_healthy(address, timeout) if stage in MeshConfig.HTTP_STAGES else is_serving(address, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--http", action="store_true", help="an HTTP stage (the api): GET /health")
    args = parser.parse_args()
    ok = is_healthy(args.address, args.timeout) if args.http else is_serving(args.address, args.service, args.timeout)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
