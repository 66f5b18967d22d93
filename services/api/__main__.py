"""The api process: the OpenAI-compatible HTTP API over uvicorn, a client of the gateway's public gRPC API.

    python -m services.api --config FILE [--replica N]
"""

import argparse
import asyncio
import logging
import signal

import uvicorn
from prometheus_client import start_http_server

from services.api.app import create_app
from services.runtime.config import load_config
from services.runtime.security import CERT, KEY
from services.runtime.server import die_with_launcher

log = logging.getLogger("api")


async def serve(cfg, replica: int) -> None:
    r = cfg.api.replicas[replica]
    host = r.bind_address.rsplit(":", 1)[0]
    start_http_server(r.metrics_port, addr=host)
    # httptools: requests parsed and replies framed in C, not h11's Python (a streamed token costs less CPU).
    tls = {} if cfg.security.dir is None else {"ssl_certfile": str(cfg.security.dir / CERT), "ssl_keyfile": str(cfg.security.dir / KEY)}
    config = uvicorn.Config(create_app(cfg), host=host, port=r.port, loop="asyncio", http="httptools", lifespan="on",
                            access_log=False, log_level="warning", timeout_graceful_shutdown=5, **tls)
    log.info("api[%d] serving on http%s://%s (gateway %s, metrics :%d)", replica, "s" if tls else "", r.bind_address,
             cfg.gateway.replicas[0].address, r.metrics_port)
    await uvicorn.Server(config).serve()
    log.info("api[%d] stopped", replica)


def main() -> None:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m services.api")
    parser.add_argument("--config", required=True, help="mesh config (YAML)")
    parser.add_argument("--replica", type=int, default=0, help="which api replica in the config")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s api[{args.replica}] %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    if not 0 <= args.replica < len(cfg.api.replicas):
        parser.error(f"--replica {args.replica}: the config lists {len(cfg.api.replicas)} api replica(s)")
    # uvicorn stops on SIGINT / SIGTERM, then sends the signal again to whatever handled it before: this no-op, so
    # a stop it finished exits 0 as every stage's does.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    asyncio.run(serve(cfg, args.replica))


if __name__ == "__main__":
    main()
