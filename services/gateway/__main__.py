from services.gateway.server import build
from services.runtime.server import main

# A request over the public limit fails with RESOURCE_EXHAUSTED before it is parsed
main("gateway", build, max_message_bytes=lambda cfg: cfg.limits.max_request_bytes)
