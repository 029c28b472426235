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
    every call's arguments are recorded in `calls`."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.calls: list[tuple[tuple, dict]] = []

    def options(self, stream: bool) -> FakeHandle:
        return self

    @property
    def generate(self) -> Any:
        handle = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs) -> FakeResponse:
                handle.calls.append((args, kwargs))
                return FakeResponse(handle.replica.generate(*args, **kwargs))

        return Method()
