"""The FastAPI application: routes, body limits, auth, error bodies."""

from __future__ import annotations

from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from server.api.auth import require_api_key
from server.api.chat import create_chat_completion
from server.api.completions import create_completion
from server.api.errors import ApiError, from_validation_error, install_error_handlers
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.serving import ServingContext
from server.config import ServerConfig
from server.metrics import exposition
from server.metrics.process import package_version
from server.metrics.requests import RequestMetrics
from server.runtime.engine import RequestRejected


def check_json_content_type(request: Request) -> None:
    """Bodies are JSON: a missing Content-Type is taken as JSON, any other type is refused (as FastAPI
    does), so a web page cannot post here cross-site as a form or text/plain without a CORS preflight."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise ApiError(415, f"Content-Type '{declared}' is not accepted; send the body as JSON with "
                       "'Content-Type: application/json'.", code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes (declared or sent)."""
    def too_large() -> ApiError:
        return ApiError(413, f"The request body is larger than this server's limit of {limit} bytes "
                        "(--max-body-bytes); send a smaller request.", code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large()
    return bytes(body)


Body = TypeVar("Body", bound=BaseModel)
READ_METHODS = ["GET", "HEAD"]  # load balancers and uptime probes often send HEAD; uvicorn drops the body


def parse_body(model: type[Body], raw: bytes) -> Body:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def create_app(engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine` (a started server.runtime.engine.Engine, or anything with its interface)."""
    version = package_version()
    ctx = ServingContext(engine=engine, model_name=engine.model_name, max_body_bytes=config.max_body_bytes,
                         system_fingerprint=f"turboserve-{version}")
    app = FastAPI(title="turboserve", version=version)
    if config.allowed_origins:  # browsers may call us from these pages; preflights are answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "HEAD", "POST"], allow_headers=["Authorization", "Content-Type"])
    install_error_handlers(app)
    request_metrics = RequestMetrics(ctx.model_name)

    async def serve(request: Request, model: type[Body], create):
        """Parse the body and `create` the response; each client mistake refused on the way counts once."""
        try:
            check_json_content_type(request)
            return await create(ctx, request, parse_body(model, await read_body(request, ctx.max_body_bytes)))
        except ApiError as exc:
            # What the engine refused at submit (the error's cause) it counted itself; 499 is a client
            # that left, which the engine counts as an abort.
            if 400 <= exc.status < 499 and not isinstance(exc.__cause__, RequestRejected):
                request_metrics.on_failure("bad_request")
            raise

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key(config.api_key))])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, ChatCompletionRequest, create_chat_completion)

    @v1.post("/completions")
    async def completions(request: Request):
        return await serve(request, CompletionRequest, create_completion)

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "turboserve",
                "max_model_len": ctx.max_model_len}

    @v1.api_route("/models", methods=READ_METHODS)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.api_route("/models/{model:path}", methods=READ_METHODS)
    async def model(model: str):
        ctx.check_model(model)
        return model_card()

    app.include_router(v1)

    @app.api_route("/health", methods=READ_METHODS)
    async def health():
        if engine.is_alive():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": "the engine loop is not running"}, status_code=503)

    @app.api_route("/version", methods=READ_METHODS)
    async def version_route():
        return {"version": version}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics():
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    return app
