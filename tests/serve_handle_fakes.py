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


class FakeHandle:
    """`handle.options(stream=True).generate.remote(*args, **kwargs)` -> the replica's `generate`;
    every call's arguments are recorded in `calls`, and the transport it went over in `transports`
    ("grpc" for a handle with `_by_reference=False`, else "ray"). Views made by `options` share both."""

    def __init__(self, replica: Any, by_reference: bool = True, calls: list | None = None,
                 transports: list | None = None) -> None:
        self.replica = replica
        self.by_reference = by_reference
        self.calls: list[tuple[tuple, dict]] = [] if calls is None else calls
        self.transports: list[str] = [] if transports is None else transports

    def options(self, stream: bool, _by_reference: bool = True) -> FakeHandle:
        return FakeHandle(self.replica, _by_reference, self.calls, self.transports)

    @property
    def generate(self) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs) -> FakeResponse:
                handle.calls.append((args, kwargs))
                handle.transports.append("ray" if handle.by_reference else "grpc")
                return FakeResponse(handle.replica.generate(*args, **kwargs))

        return Method()
