"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A failure with its HTTP status; `param` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not str(part).startswith("function-"):  # pydantic's names for custom validators
            path += f".{part}" if path else str(part)
    return path


def from_validation_error(exc: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming its field."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON ({first['msg']}); send a JSON object.",
                        code="invalid_json")
    param = field_path(first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return ApiError(400, f"'{param}' is required.", param=param, code="missing_required_parameter")
    if first["type"].startswith("model_") and not param:
        return ApiError(400, "The request body must be a JSON object.", code="invalid_type")
    shown = repr(first["input"])
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ApiError(400, f"Invalid value for '{param}': {message} (got {shown}).", param=param,
                    code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods: same body shape as everything else.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return ApiError(500, f"Internal server error: {type(exc).__name__}: {exc}", type="internal_error",
                        code="internal_error").response()
