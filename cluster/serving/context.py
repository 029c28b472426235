"""The id of the HTTP request being served, for logs and error bodies (a context variable: each
request's task sees its own)."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
_VALID_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")  # printable ASCII, no spaces

_request_id: ContextVar[str | None] = ContextVar("pagedserve_request_id", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


def set_request_id(request_id: str | None):
    """Set the current request's id; returns the token for `reset_request_id`."""
    return _request_id.set(request_id)


def reset_request_id(token) -> None:
    _request_id.reset(token)


def is_valid_request_id(value: str) -> bool:
    """1 to MAX_REQUEST_ID_CHARS printable ASCII characters, no spaces (what a client may send)."""
    return _VALID_ID.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex
