"""Errors as OpenAI error bodies: `APIError`, the mapping of validation, HTTP and engine exceptions to
it, and the handlers that make every error the FastAPI app returns one of these bodies."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.serving.context import current_request_id
from pagedserve.cluster.serving.request_stages import current_stages
from pagedserve.cluster.serving.responses import ErrorInfo
from pagedserve.cluster.serving.streams import RequestFailedError
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

# "field: ...", "field.sub.path: ..." or "field[2].sub: ...": the top-level request field is the error's param.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:[.\[][A-Za-z0-9_.\[\]]+)?:")


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.info)

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote text that UTF-8 cannot carry."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(info: ErrorInfo) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, plus the request id when one is known."""
    error: dict[str, Any] = info.model_dump()
    request_id = current_request_id()
    if request_id is not None:
        error["request_id"] = request_id
    stages = current_stages()
    if stages is not None and stages.trace_id is not None:
        error["trace_id"] = stages.trace_id
    return {"error": error}


# HTTP status -> OpenAI error type, for errors raised by the framework (unknown route, bad method, ...).
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "NotFoundError", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable_error"}


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> APIError:
    kind = _STATUS_TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return APIError(status, message, type=kind, code=code, headers=headers)


def internal_error(exc: BaseException) -> APIError:
    """500 for the unexpected: logged with the request id; the body names only the exception's type."""
    logger.error("request %s failed: %r", current_request_id(), exc, exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); request id {current_request_id()}",
                    type="internal_server_error")


def _loc_param(loc: tuple) -> str | None:
    names = [str(part) for part in loc if isinstance(part, str) and part != "body"]
    return ".".join(names) if names else None


def _msg(error: dict) -> str:
    return str(error.get("msg", "")).removeprefix("Value error, ")


def error_param(error: dict) -> str | None:
    """A pydantic error's field: its location, else (model-level checks) the message's 'field:' prefix."""
    param = _loc_param(tuple(error.get("loc", ())))
    if param is not None:
        param = param.split(".")[0]  # the top-level request field
    else:
        match = _FIELD_PREFIX.match(_msg(error))
        param = match.group(1) if match else None
    return param


def errors_message(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        loc = _loc_param(tuple(e.get("loc", ())))
        parts.append(f"{loc}: {_msg(e)}" if loc else _msg(e))
    return "; ".join(parts) or "invalid request"


def bad_request(exc: Exception) -> APIError:
    """400 from a ValueError: the field comes from a pydantic error's location or a 'field: ...' message."""
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        return APIError(400, errors_message(errors), param=error_param(errors[0]) if errors else None)
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    return APIError(400, message, param=match.group(1) if match else None)


def engine_error(exc: BaseException) -> APIError:
    """Map an engine/coordinator exception to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), type="service_unavailable_error", code="overloaded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(exc)
    if isinstance(exc, RequestFailedError):
        logger.error("request %s failed in the engine: %s", current_request_id(), exc)
        return APIError(500, f"the request failed in the engine: {exc}; request id {current_request_id()}",
                        type="internal_server_error", code="request_failed")
    return internal_error(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises becomes an OpenAI error body with its status (never FastAPI's
    `{"detail": ...}` or plain text): API errors, malformed JSON and validation errors (400), the
    framework's HTTP errors (404 unknown route, 405 wrong method, 413, ...), and anything else (500)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return APIError(400, errors_message(errors), param=error_param(errors[0]) if errors else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response()
