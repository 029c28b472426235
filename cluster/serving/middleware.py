"""The ASGI layer around the app: request ids, the API key, the body size limit, and the last line of
defence that turns any unexpected exception into an OpenAI error body (500), counting every error
response in `/metrics` by status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.serving.context import (
    REQUEST_ID_HEADER,
    current_request_id,
    request_id_from_header,
    reset_request_id,
    set_request_id,
)
from pagedserve.cluster.serving.errors import APIError, http_error, internal_error

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read; an HTTPException, so the framework passes it on unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class ServingMiddleware:
    """Request id (the client's valid `X-Request-Id`, else a new one) on every response and in the
    context of everything the request runs; API key check except on open paths; 413 for a body over
    `max_body_bytes` (by Content-Length, or counted while streaming in); 500 for anything unexpected."""

    def __init__(self, app: Callable, serving: Any, open_paths: frozenset[str]) -> None:
        self.app = app
        self.serving = serving
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        token = set_request_id(request_id_from_header(headers.get(REQUEST_ID_HEADER.lower())))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"],
                                      (REQUEST_ID_HEADER.lower().encode(), current_request_id().encode())]
                if message["status"] >= 400:
                    self.serving.metrics.observe_error(message["status"])
            await send(message)

        try:
            error = self._refuse_early(scope, headers)
            if error is not None:
                await error.response()(scope, receive, send_with_id)
                return
            await self.app(scope, self._limited(receive), send_with_id)
        except Exception as exc:  # noqa: BLE001 - the last line: never plain text, never a dropped connection
            if started:
                raise
            error = http_error(413, exc.detail) if isinstance(exc, BodyTooLarge) else internal_error(exc)
            await error.response()(scope, receive, send_with_id)
        finally:
            reset_request_id(token)

    def _refuse_early(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        """401 or 413 from the headers alone, before the body is read."""
        if self.serving.args.api_key_digest is not None and scope.get("path") not in self.open_paths:
            try:
                self.serving.check_api_key(headers.get("authorization"))
            except APIError as exc:
                return exc
        limit = self.serving.args.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return http_error(413, BodyTooLarge(limit).detail)
        return None

    def _limited(self, receive: Receive) -> Receive:
        limit = self.serving.args.max_request_body_bytes
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        return receive_limited
