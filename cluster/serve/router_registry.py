"""The request routers alive in this process, so that the ingress can read what they know (/metrics).

Kept apart from `serve_router`: Serve pickles a request router's module by value, and this registry
must be the one module-level table of the process, imported by reference."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_ROUTERS: dict[tuple[str, str], "weakref.WeakSet[Any]"] = {}
_LOCK = threading.Lock()


def register(app_name: str, deployment_name: str, router: Any) -> None:
    with _LOCK:
        _ROUTERS.setdefault((app_name, deployment_name), weakref.WeakSet()).add(router)


def routers_for(app_name: str, deployment_name: str) -> list[Any]:
    """The routers this process holds for one deployment (one per handle that has routed)."""
    with _LOCK:
        return list(_ROUTERS.get((app_name, deployment_name), ()))
