"""Requests on their way in: the waiting queue, in its policy's order (one class per policy:
core/request_queue.py), and the requests held back (WAITING_FOR_GRAMMAR) while their grammar compiles
in the structured-output manager's workers. A compiled grammar sends its request to the queue; a compile
that fails or times out is reported, and the engine core finishes that request with "error"."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.request_queue import RequestQueue, create_request_queue

if TYPE_CHECKING:
    from pagedserve.engine.structured_output.manager import StructuredOutputManager


class Admission:
    def __init__(self, policy: str, structured_output: Callable[[], StructuredOutputManager] | None) -> None:
        # The policy lives in the queue: serving order, where preempted requests go, who is preempted.
        self.waiting: RequestQueue = create_request_queue(policy)
        # Returns the engine's structured-output manager (made on first use: xgrammar loads lazily).
        self.structured_output = structured_output
        # Requests whose grammar is still compiling, in arrival order, and those whose compile failed.
        self._waiting_for_grammar: dict[str, Request] = {}
        self._grammar_failures: dict[str, str] = {}

    def add(self, request: Request) -> None:
        """A new request: to the queue, or held while its grammar compiles."""
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and request.structured_output is None:
            if self.structured_output is None:
                raise ValueError("structured_outputs: this engine has no structured-output manager")
            request.structured_output = self.structured_output().new_request(constraint, request.eos_token_ids,
                                                                             request.output_token_ids)
        if request.structured_output is not None and not request.structured_output.is_ready:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._waiting_for_grammar[request.request_id] = request
            return
        self.waiting.add(request)

    def admit_compiled(self, idle: bool) -> None:
        """Move requests whose grammar has compiled into the waiting queue; record failed ones. An
        `idle` engine (nothing else to do) waits briefly for a compile here instead of spinning."""
        if not self._waiting_for_grammar:
            return
        manager = self.structured_output()
        if idle:
            manager.wait_any([r.structured_output for r in self._waiting_for_grammar.values()], 0.05)
        now = time.monotonic()
        for rid, request in list(self._waiting_for_grammar.items()):
            if rid in self._grammar_failures:
                continue
            error = request.structured_output.poll(now, manager.compile_timeout)
            if error is not None:
                self._grammar_failures[rid] = error
            elif request.structured_output.is_ready:
                del self._waiting_for_grammar[rid]
                request.status = RequestStatus.WAITING
                self.waiting.add(request)

    def take_grammar_failures(self) -> dict[str, str]:
        """Requests whose grammar failed to compile since the last call -> why."""
        failures, self._grammar_failures = self._grammar_failures, {}
        return failures

    def remove(self, requests: Iterable[Request]) -> None:
        """Take finished requests out of the queue and the grammar wait (O(1) each)."""
        requests = list(requests)
        self.waiting.remove(requests)
        for request in requests:
            self._waiting_for_grammar.pop(request.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._waiting_for_grammar)
