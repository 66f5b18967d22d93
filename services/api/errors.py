"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status each gRPC
status of the gateway maps to."""

import json
import math

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from pydantic import ValidationError
from starlette.responses import Response

INVALID = "invalid_request_error"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), self.status, self.headers, media_type="application/json")


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> ApiError:
    return bad(f"{param}: {what or 'not supported by this server'}", param, "unsupported_parameter")


# Statuses the client caused get 4xx: retrying the same request cannot help (the OpenAI SDK retries 429 and 5xx).
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID, None),
    grpc.StatusCode.OUT_OF_RANGE: (400, INVALID, None),
    # Asks for what this deployment cannot do (speech without a talker).
    grpc.StatusCode.FAILED_PRECONDITION: (400, INVALID, "unsupported_request"),
    # A limit of the request itself (pixels, seconds, items): 400 like every other bad-media case; overload comes
    # with a retry hint and is 429.
    grpc.StatusCode.RESOURCE_EXHAUSTED: (400, INVALID, "over_limit"),
    grpc.StatusCode.UNAUTHENTICATED: (401, INVALID, "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, INVALID, None),
    grpc.StatusCode.NOT_FOUND: (404, INVALID, None),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "deadline_exceeded"),
}
PUSHBACK = "grpc-retry-pushback-ms"


def retry_after(e: grpc.aio.AioRpcError) -> float | None:
    """Seconds the server asks a client to wait before retrying: its google.rpc.RetryInfo, or its pushback trailer."""
    try:
        status = rpc_status.from_call(e)
    except ValueError:  # details that contradict the call's own status: none to trust
        status = None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    pushback = dict(e.trailing_metadata() or ()).get(PUSHBACK)
    return int(pushback) / 1000 if pushback is not None and str(pushback).isdigit() else None


def from_grpc(e: grpc.aio.AioRpcError) -> ApiError:
    code, message = e.code(), e.details() or e.code().name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (after := retry_after(e)) is not None:
        # Overload, said the gRPC way (a retry hint): 429, retry after the time it gives, in whole seconds.
        retry = str(max(1, math.ceil(after)))
        return ApiError(429, message, "rate_limit_error", code="rate_limit_exceeded", headers={"retry-after": retry})
    status, type_, err_code = _STATUS.get(code, (500, "server_error", None))
    return ApiError(status, message, type_, code=err_code)


def _path(loc: tuple, body) -> list:
    """pydantic's location of an error, as the client wrote it: the labels pydantic adds for the branches of a
    union (a part's type, `str`, `list[...]`) dropped, walking the body itself."""
    path, node, tagged = [], body, False
    for seg in loc:
        if isinstance(node, dict) and not tagged and seg in (node.get("type"), node.get("role")):
            tagged = True  # a tagged union's branch: named by the value the body has there
            continue
        if isinstance(node, dict) and seg in node or isinstance(node, list) and isinstance(seg, int):
            node = node[seg] if isinstance(node, dict) or seg < len(node) else None
            path.append(seg)
            tagged = False
            continue
        if isinstance(seg, str) and (seg in ("str", "int", "float", "bool", "none") or "[" in seg or "-" in seg):
            continue  # a plain union's branch
        path.append(seg)  # a field the body lacks
        node = None
    return path


def _where(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def from_validation(e: ValidationError, body) -> ApiError:
    """The most specific problem pydantic found in `body`, named as OpenAI names it (an unknown field:
    "Unrecognized request argument supplied")."""
    errors = [(err, _path(err["loc"], body)) for err in e.errors(include_url=False)]
    err, path = max(errors, key=lambda ep: len(ep[1]))  # the deepest: a union's other branches fail at its top
    where = _where(path)
    if err["type"] == "extra_forbidden":
        return bad(f"Unrecognized request argument supplied: {where}", where, "unknown_parameter")
    if err["type"] == "union_tag_invalid":
        ctx = err.get("ctx", {})
        field = str(ctx.get("discriminator", "")).strip("'")
        return bad(f"{where}.{field}: {ctx.get('tag')!s} is not supported (expected one of {ctx.get('expected_tags')})",
                   f"{where}.{field}", "unsupported_value")
    if err["type"] == "model_type" and not path:
        return bad("the body must be a JSON object", None, "invalid_json")
    return bad(f"{where}: {err['msg']}" if where else err["msg"], where or None, "invalid_value")
