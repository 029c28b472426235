"""The one ingress deployment's own parts (its HTTP behaviour runs in tests/test_serve_scaleout.py and
tests/test_pd_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace


def test_the_ingress_names_its_replica_without_touching_the_streamed_body():
    import asyncio

    from pagedserve.cluster.serve.ingress import ServedBy

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for chunk in (b"a", b"b"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(ServedBy(app, "r-1")({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"content-type", b"text/plain"), (b"x-pagedserve-ingress", b"r-1")]
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b", b""]


def ingress_init():
    """PagedServeIngress.__init__ as written in ingress.py (Serve wraps the class for ASGI)."""
    from pagedserve.cluster.serve import ingress

    return next(vars(c)["__init__"] for c in ingress.PagedServeIngress.func_or_class.__mro__
                if "__init__" in vars(c) and c.__module__ == ingress.__name__)


def test_the_ingress_loads_its_tokenizer_while_it_waits_for_the_engines(tiny_llama, monkeypatch):
    """A replica's start-up: the tokenizer (a GGUF file's takes seconds) loads while `connect` waits for
    the engines, not after it. Here `connect` returns only once the tokenizer has loaded: in series
    that is a timeout."""
    import asyncio
    import threading

    from pagedserve.cluster.serve import ingress
    from pagedserve.cluster.settings import ServeArgs
    from pagedserve.engine import tokenizer as tokenizer_module

    loaded = threading.Event()
    real_load = tokenizer_module.load_tokenizer

    def load_and_tell(path: str):
        tokenizer = real_load(path)
        loaded.set()
        return tokenizer

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", load_and_tell)

    class Stats:
        def aggregate_stats(self):
            return None

    async def connect(args, upstream):
        assert await asyncio.to_thread(loaded.wait, 30), "connect waited for the tokenizer"
        return ingress.EngineConnection(Stats(), [{"max_model_len": 64}], 64)

    replica = SimpleNamespace()  # (the body of the replica's __init__, without Serve's ASGI wrapper around it)
    args = ServeArgs(model=str(tiny_llama), kv_cache_memory="8MiB").to_dict()
    asyncio.run(asyncio.wait_for(ingress_init()(replica, args, connect, None), 120))
    assert loaded.is_set() and replica.serving.vocab_size == len(real_load(str(tiny_llama)))


def test_a_failed_connect_is_raised_before_a_failed_tokenizer(tiny_llama, monkeypatch):
    """When both fail, the engines' failure is the one reported (as when the tokenizer loaded after)."""
    import asyncio
    import threading

    import pytest

    from pagedserve.cluster.settings import ServeArgs
    from pagedserve.engine import tokenizer as tokenizer_module

    started = threading.Event()

    def broken_tokenizer(path: str):
        started.set()
        raise ValueError("tokenizer: unreadable")

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", broken_tokenizer)

    async def connect(args, upstream):
        assert await asyncio.to_thread(started.wait, 30)  # the tokenizer has already failed by now
        raise ConnectionError("no engine came up")

    args = ServeArgs(model=str(tiny_llama), kv_cache_memory="8MiB").to_dict()
    with pytest.raises(ConnectionError, match="no engine came up"):
        asyncio.run(ingress_init()(SimpleNamespace(), args, connect, None))
