"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, from every path."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.common import error_body

log = logging.getLogger("h2o_server")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None):
    kind = {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        problems = []
        for err in e.errors():
            if err.get("type") == "json_invalid":
                reason = err.get("ctx", {}).get("error", "")
                return error_response(400, f"the request body is not valid JSON: {reason}")
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            reason = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {reason}" if where else reason)
        first = e.errors()[0].get("loc", ()) if e.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error_response(400, "; ".join(problems) or "invalid request", None, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(HTTPException)
    async def fastapi_http_error(request: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(e).__name__}")
