"""The OpenAI-compatible HTTP app: /v1/models, /v1/chat/completions, /v1/audio/speech, /v1/realtime (a WebSocket),
/health and /metrics, each request translated into one call of the public gRPC API (the gateway stays the only
orchestrator); and the browser page at /."""

import contextlib
import json
import time
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from services.api import chat, realtime, speech
from services.api.audio_store import AudioStore
from services.api.errors import ApiError, bad, from_validation
from services.api.guard import Guard
from services.api.media import Fetcher
from services.api.metrics import Metrics
from services.api.schema import ChatRequest, SpeechRequest
from services.api.translate import chat_request, check_size, speech_request
from services.api.upstream import Gone, Upstream, next_event, unless_gone
from services.runtime.config import MeshConfig

OWNER = "omni-mesh"
PAGE = Path(__file__).with_name("static")  # the browser page: plain files, no build step


def max_body_bytes(cfg: MeshConfig) -> int:
    """The gateway's request limit as it arrives over HTTP: media in base64 (4/3 of their bytes) inside JSON."""
    return cfg.limits.max_request_bytes * 4 // 3 + (64 << 10)


async def parse(request: Request, model: type[BaseModel]):
    body = await request.body()
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e, data) from None


def create_app(cfg: MeshConfig) -> FastAPI:
    upstream = Upstream(cfg.gateway.replicas[0].address, cfg.api.request_timeout_s, cfg.security)
    store = AudioStore()
    fetcher = Fetcher(max_body_bytes(cfg)) if cfg.api.allow_url_fetch else None
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await upstream.close()
        if fetcher is not None:
            await fetcher.close()

    app = FastAPI(title="omni-mesh", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(Gone)
    async def gone(request, e: Gone):
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    @app.get("/health")
    async def health():
        """200 once the gateway answers (the launcher's and the container's readiness check), 503 while it does not."""
        try:
            info = await upstream.info(fresh_s=0.0)
        except ApiError as e:
            return JSONResponse({"status": "unavailable", "detail": e.message}, 503)
        return {"status": "ok", "model": info.model}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": OWNER}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card((await upstream.info()).model)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        return model_card((await upstream.model(model)).model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatRequest)
        info = await upstream.model(req.model)
        gen = await chat_request(req, store, fetcher)
        check_size(gen, info.limits.max_request_bytes)
        reply, call = chat.Reply(req, info.model, store), upstream.generate(gen)
        if not req.stream:
            return await unless_gone(request, call, chat.collect(reply, call))
        first = await unless_gone(request, call, next_event(call))  # a refusal is an HTTP status, not an event
        return chat.stream(reply, first, call)

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request):
        req = await parse(request, SpeechRequest)
        info = await upstream.model(req.model)
        gen = speech_request(req)
        check_size(gen, info.limits.max_request_bytes)
        call = upstream.generate(gen)
        first = await unless_gone(request, call, speech.first_audio(call))
        return speech.reply(req, first, call)

    @app.websocket("/v1/realtime")
    async def realtime_session(ws: WebSocket):
        await realtime.serve(ws, upstream, [k.encode() for k in cfg.security.keys])

    @app.get("/")
    async def page():
        return FileResponse(PAGE / "index.html")

    app.mount("/page", StaticFiles(directory=PAGE), name="page")

    # Outermost first: every answer is counted, the refused ones too.
    app.add_middleware(Guard, keys=cfg.security.keys, max_body=max_body_bytes(cfg))
    app.add_middleware(Metrics)
    return app
