"""Asks a stage for its gRPC health: exit 0 when it serves, 1 otherwise (container health checks).

    python -m services.runtime.probe HOST:PORT [--service NAME] [--timeout S]
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout: float = 2.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    sys.exit(0 if is_serving(args.address, args.service, args.timeout) else 1)


if __name__ == "__main__":
    main()
