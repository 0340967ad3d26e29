"""Errors in each API's own shape, from every path: OpenAI's {"error": {"message", "type",
"param", "code"}}, and Anthropic's {"type": "error", "error": {"type", "message"}} under
/v1/messages (its clients parse only that)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.common import error_body

log = logging.getLogger("h2o_server")


class APIError(Exception):
    """`details`: Anthropic's `error.details` (its machine-readable `error_code`)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        details: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.details = details


ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error types by status (its API reference, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_path(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_body(status: int, message: str, details: dict | None = None) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    error = {"type": kind, "message": message}
    return {"type": "error", "error": {**error, "details": details} if details else error}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    anthropic: bool = False,
    details: dict | None = None,
):
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    if anthropic:
        body = anthropic_body(status, message, details)
        return JSONResponse(body, status_code=status, headers=headers)
    body = error_body(message, openai_type(status), code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def openai_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    return {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def install_error_handlers(app: FastAPI) -> None:
    def shaped(request: Request, status: int, message: str, code=None, param=None, details=None):
        anthropic = anthropic_path(request.url.path)
        return error_response(status, message, code, param, anthropic, details)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return shaped(request, e.status, e.message, e.code, e.param, e.details)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        problems = []
        for err in e.errors():
            if err.get("type") == "json_invalid":
                reason = err.get("ctx", {}).get("error", "")
                return shaped(request, 400, f"the request body is not valid JSON: {reason}")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            reason = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {reason}" if where else reason)
        first = e.errors()[0].get("loc", ()) if e.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return shaped(request, 400, "; ".join(problems) or "invalid request", None, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return shaped(request, e.status_code, str(e.detail))

    @app.exception_handler(HTTPException)
    async def fastapi_http_error(request: Request, e: HTTPException):
        return shaped(request, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return shaped(request, 500, f"internal error: {type(e).__name__}")
