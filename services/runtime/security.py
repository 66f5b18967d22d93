"""Who may reach a stage. With `security.tls_dir`, the public ports (the gateway, the HTTP door) serve TLS and the
internal stages mutual TLS: every process of the mesh holds the one mesh certificate, signed by the mesh's CA, and a
stage accepts only peers presenting a certificate of that CA. With `security.keys`, the public APIs want one of them
as `authorization: Bearer KEY`."""

import hmac

import grpc

from services.runtime.config import SecurityConfig

CA, CERT, KEY = "ca.pem", "mesh.pem", "mesh-key.pem"
PUBLIC_STAGES = ("gateway", "api")  # their clients are the world's: no client certificate, keys instead


def _read(cfg: SecurityConfig, name: str) -> bytes:
    return (cfg.dir / name).read_bytes()


def server_credentials(cfg: SecurityConfig, stage: str) -> grpc.ServerCredentials | None:
    """TLS for a stage's port (None: plaintext); internal stages ask their callers for a mesh certificate."""
    if cfg.dir is None:
        return None
    internal = stage not in PUBLIC_STAGES
    return grpc.ssl_server_credentials([(_read(cfg, KEY), _read(cfg, CERT))],
                                       root_certificates=_read(cfg, CA) if internal else None,
                                       require_client_auth=internal)


def channel_credentials(cfg: SecurityConfig) -> grpc.ChannelCredentials | None:
    """How a process of the mesh calls another: the mesh's CA to trust, its certificate to show."""
    if cfg.dir is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(cfg, CA), private_key=_read(cfg, KEY),
                                        certificate_chain=_read(cfg, CERT))


def channel(cfg: SecurityConfig, address: str, options=None) -> grpc.Channel:
    creds = channel_credentials(cfg)
    return grpc.insecure_channel(address, options) if creds is None else grpc.secure_channel(address, creds, options)


def aio_channel(cfg: SecurityConfig, address: str, options=None) -> grpc.aio.Channel:
    creds = channel_credentials(cfg)
    return grpc.aio.insecure_channel(address, options) if creds is None else grpc.aio.secure_channel(address, creds, options)


def bearer(cfg: SecurityConfig) -> tuple[tuple[str, str], ...]:
    """The call metadata a mesh process (the HTTP door) sends the gateway: the first key, when keys are set."""
    return (("authorization", f"Bearer {cfg.keys[0]}"),) if cfg.keys else ()


def key_matches(keys: list[bytes], authorization: str | None) -> str | None:
    """Why `authorization` does not let its caller in (None: it does); no keys configured lets everyone in."""
    if not keys:
        return None
    if not authorization or not authorization.startswith("Bearer "):
        return "no API key: send it as `authorization: Bearer KEY`"
    given = authorization[len("Bearer "):].strip().encode()
    return None if any(hmac.compare_digest(given, k) for k in keys) else "incorrect API key"


class KeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the public services without a configured key (UNAUTHENTICATED); health and reflection stay
    open, for probes and tools."""

    def __init__(self, keys: list[str], services: tuple[str, ...]):
        self.keys, self.services = [k.encode() for k in keys], services

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not details.method.lstrip("/").startswith(self.services):
            return await continuation(details)
        why = key_matches(self.keys, dict(details.invocation_metadata or ()).get("authorization"))
        if why is None:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None

        async def refuse(request, context):  # a coroutine serves every kind of method in grpc.aio
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        make = HANDLERS[handler.request_streaming, handler.response_streaming]
        return make(refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}
