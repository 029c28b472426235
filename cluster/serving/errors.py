"""Errors as OpenAI error bodies: `APIError` and the mapping of validation and engine exceptions to it."""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedserve.cluster.serving.responses import ErrorInfo, ErrorResponse
from pagedserve.engine.async_llm import EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):")


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


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
    logger.exception("request failed", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", type="internal_server_error")
