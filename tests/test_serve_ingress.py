"""The one ingress deployment's own parts (its HTTP behaviour runs in tests/test_serve_scaleout.py and
tests/test_pd_serve.py)."""

from __future__ import annotations


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
