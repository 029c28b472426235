"""A Serve deployment handle in one process: what `ServeEngineClient` calls, answered by a local engine
replica, so a test can follow a request from the client to the engine without starting Ray Serve."""

from __future__ import annotations

from typing import Any


class FakeResponse:
    """A streaming DeploymentResponseGenerator over a replica's async generator."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __aiter__(self):
        return self.stream

    def cancel(self) -> None:
        pass


async def over_grpc(stream, serializer: Any):
    """The replica's stream as Serve's gRPC transport delivers it: every output, and the exception that
    ends it, through the serializer the handle's options chose (written, then read back)."""
    try:
        async for output in stream:
            yield serializer.loads_response(serializer.dumps_response(output))
    except Exception as exc:  # (the replica sends it as an error message; the caller's side raises it)
        raise serializer.loads_response(serializer.dumps_response(exc)) from None


class FakeHandle:
    """`handle.options(stream=True).generate.remote(*args, **kwargs)` -> the replica's `generate`;
    every call's arguments are recorded in `calls`, and the transport it went over in `transports`
    ("grpc" for a handle with `_by_reference=False`, else "ray"). Views made by `options` share both. Over
    "grpc" the arguments, outputs and exceptions go through Serve's own serializer, as its options chose."""

    def __init__(self, replica: Any, by_reference: bool = True, calls: list | None = None,
                 transports: list | None = None, serialization: dict | None = None) -> None:
        self.replica = replica
        self.by_reference = by_reference
        self.calls: list[tuple[tuple, dict]] = [] if calls is None else calls
        self.transports: list[str] = [] if transports is None else transports
        self.serialization = serialization or {}  # request_/response_serialization, as `options` set them

    def options(self, stream: bool, _by_reference: bool = True, **serialization: str) -> FakeHandle:
        return FakeHandle(self.replica, _by_reference, self.calls, self.transports, serialization)

    @property
    def generate(self) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs) -> FakeResponse:
                handle.calls.append((args, kwargs))
                handle.transports.append("ray" if handle.by_reference else "grpc")
                if handle.by_reference:
                    return FakeResponse(handle.replica.generate(*args, **kwargs))
                from ray.serve._private.serialization import RPCSerializer

                serializer = RPCSerializer(handle.serialization.get("request_serialization", "cloudpickle"),
                                           handle.serialization.get("response_serialization", "cloudpickle"))
                args = serializer.loads_request(serializer.dumps_request(args))
                kwargs = serializer.loads_request(serializer.dumps_request(kwargs))
                return FakeResponse(over_grpc(handle.replica.generate(*args, **kwargs), serializer))

        return Method()
