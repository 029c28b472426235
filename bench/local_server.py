"""A server the bench starts itself (`bench serve --start-server`, the routing comparison): the app on a Ray
instance of its own on loopback, deleted at the end."""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class LocalServer:
    """A server this process started on 127.0.0.1 (`start_server`), stopped by `stop()`."""

    url: str
    app_name: str
    args: Any = None  # the app's ServeArgs

    @classmethod
    def start(cls, model: str, port: int, settings: dict[str, Any]) -> "LocalServer":
        import ray

        from pagedserve.cluster.serve import direct_ingress
        from pagedserve.cluster.serve.app import server_url, start_server
        from pagedserve.cluster.settings import ServeArgs

        args = ServeArgs(model=model, host="127.0.0.1", port=port, **settings)
        if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
            # A Ray of its own on loopback (as the tests run it): address="local" never joins another
            # session that happens to run on this machine. Started as `pagedserve serve` starts one (its
            # ingress serving the port directly where the settings allow), so the bench measures that path.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            direct_ingress.start_ray(args, address="local")
        print(f"starting a server for {args.model} on 127.0.0.1:{port} ({settings}) ...", file=sys.stderr,
              flush=True)
        start_server(args)
        _stop_on_sigterm()  # after Ray started: it installs SIGTERM handlers of its own
        if direct_ingress.serves_directly(args):
            print("the server's ingress replica serves its port itself (direct ingress, as `pagedserve serve` on a Ray "
                  "of its own; --no-direct-ingress: through Serve's proxy)", file=sys.stderr, flush=True)
        return cls(server_url(args), args.app_name, args)

    def stop(self, everything: bool = True) -> None:
        """Delete the app (its engines stop); with `everything`, shut Serve down too, and with it the Ray that
        `start` began, if it began one. That Ray goes as `pagedserve serve` leaves one (every app deleted, then
        Ray shut down):
        `serve.shutdown()` kills Serve's controller while its own calls are pending, which Ray prints as a
        failed task at the end of every run. Bounded as `pagedserve serve`'s stop is (`stop_server`): a
        bench whose process group got a signal (its Ray's raylet with it) still exits."""
        from pagedserve.cluster.serve import direct_ingress
        from pagedserve.cluster.serve.app import shutdown_server, stop_server

        if not (everything and direct_ingress.started_here()):
            shutdown_server(None if everything else self.app_name)
            return
        grace = getattr(self.args, "graceful_shutdown_timeout_s", None)
        stop_server(None, timeout_s=90.0 if grace is None else grace + 30.0)


def _stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, `kill`, a CI job's cancel) as Ctrl-C: KeyboardInterrupt in the main thread, so the
    bench's `finally` stops its server. Ray's driver handlers would abort the process instead (its core
    worker's C handler) and leave the app's processes behind. A handler the embedding program installed
    itself stays."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current in (signal.SIG_DFL, None) or getattr(current, "__module__", "").startswith("ray."):
        signal.signal(signal.SIGTERM, signal.default_int_handler)
