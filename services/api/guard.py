"""What every /v1 request passes before a handler sees it: its API key (when keys are configured) and the size of its
body, refused from Content-Length before any of it is read, or as soon as a body sent in chunks grows past it."""

from services.api.errors import ApiError
from services.runtime.security import key_matches


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


class TooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over this server's limit of {limit} bytes", code="request_too_large")


class Guard:
    def __init__(self, app, keys: list[str], max_body: int):
        self.app, self.keys, self.max_body = app, [k.encode() for k in keys], max_body

    def _refusal(self, scope) -> ApiError | None:
        if (why := key_matches(self.keys, _header(scope, b"authorization"))) is not None:
            return ApiError(401, why[0].upper() + why[1:] + ".", code="invalid_api_key")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return TooLarge(self.max_body)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if (refusal := self._refusal(scope)) is not None:
            return await refusal.response()(scope, receive, send)
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise TooLarge(self.max_body)  # answered by the app's ApiError handler
            return message

        await self.app(scope, bounded, send)
