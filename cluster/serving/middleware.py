"""The ASGI layer around the app: request ids, the API key, the body size limit, and the last line of
defence that turns any unexpected exception into an OpenAI error body (500), counting every error
response in `/metrics` by status.

X-Request-Id: the client's, if it sends one (a malformed one is a 400), else a new one. Behind Ray
Serve's proxy the proxy already puts one on every request and copies it onto the response, so the
app does not add its own (`set_request_id_header=False`): the header comes back exactly once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.serving.context import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_HEADER,
    is_valid_request_id,
    new_request_id,
    reset_request_id,
    set_request_id,
)
from pagedserve.cluster.serving.errors import APIError, http_error, internal_error
from pagedserve.cluster.serving.request_stages import begin_request, end_request
from pagedserve.cluster.serving.tracing import TRACE_ID_HEADER

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body is read; an HTTPException, so the framework passes it on unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class ServingMiddleware:
    """Request id (the client's `X-Request-Id`, else a new one) in the context of everything the request
    runs and, unless a proxy in front sets it (`set_request_id_header`), on every response; 400 for a
    malformed one; API key check except on open paths; 413 for a body over `max_body_bytes` (by
    Content-Length, or counted while streaming in); 500 for anything unexpected."""

    def __init__(self, app: Callable, serving: Any, open_paths: frozenset[str],
                 set_request_id_header: bool = True) -> None:
        self.app = app
        self.serving = serving
        self.open_paths = open_paths
        self.set_request_id_header = set_request_id_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        sent_id = headers.get(REQUEST_ID_HEADER.lower())
        malformed = sent_id is not None and not is_valid_request_id(sent_id)
        if not malformed and sent_id is not None:
            request_id: str | None = sent_id
        else:  # behind a proxy that echoes a malformed id, none of ours would match it: name none
            request_id = None if malformed and not self.set_request_id_header else new_request_id()
        token = set_request_id(request_id)
        started = False
        # Where the request's time goes (overhead metrics), and with tracing on its trace (POSTs: inference).
        stages, stages_token = begin_request(scope.get("method", ""), scope.get("path", ""))
        tracing = self.serving.tracing if scope.get("method") == "POST" else None
        root = tracing.start(headers, stages) if tracing is not None else None
        if root is not None:
            stages.trace_id = root.trace_id

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.set_request_id_header:
                    message["headers"] = [*message.get("headers", []),
                                          (REQUEST_ID_HEADER.lower().encode(), str(request_id).encode())]
                if root is not None:
                    message["headers"] = [*message.get("headers", []), (TRACE_ID_HEADER.encode(), root.trace_id.encode()),
                                          (b"traceparent", root.traceparent.encode())]
                stages.status = message["status"]
                if message["status"] >= 400:
                    self.serving.metrics.observe_error(message["status"])
            await send(message)

        try:
            error = _malformed_id_error(sent_id) if malformed else self._refuse_early(scope, headers)
            stages.mark("auth")
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
            stages.mark("responded")
            if root is not None:
                try:
                    tracing.finish(root, stages, request_id)  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 - a trace never fails its request
                    logger.exception("building the trace of request %s failed", request_id)
            end_request(stages_token)
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


def _malformed_id_error(value: str) -> APIError:
    return APIError(400, f"{REQUEST_ID_HEADER}: must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
                         f"without spaces (got {len(value)} characters)", param=REQUEST_ID_HEADER)
