"""Route keys (which replica a request belongs to) and the forwarding of a request through an ASGI app, without
Ray: wkvm/cluster/forward.py imports none of it."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from wkvm.cluster.forward import ForwardedRequest, Head, route_key, run_asgi, state_key


def req(method, path, body=None, headers=()):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    return ForwardedRequest(method, path, b"", [(k.encode(), v.encode()) for k, v in headers], raw)


def test_named_states_route_by_tenant_and_name():
    k = state_key("t", "chat")
    assert state_key("t", "chat@3") == k and state_key("u", "chat") != k
    for r in (req("GET", "/v1/states/chat@2"), req("POST", "/v1/states/chat/generate", {"prompt": "x"}),
              req("POST", "/v1/states", {"name": "chat", "prompt": "x"}),
              req("POST", "/v1/chat/completions", {"state": "chat@1", "messages": []}),
              req("POST", "/v1/completions", {"save_state": "chat", "prompt": "x"})):  # fmt: skip
        assert route_key("t", r).key == k and route_key("t", r).strict, r.path


def test_sessions_route_by_chat_header_or_user_and_the_rest_anywhere():
    a = route_key("t", req("POST", "/v1/chat/completions", {"messages": []}, [("x-openwebui-chat-id", "c1")]))
    b = route_key("u", req("POST", "/v1/chat/completions", {"messages": []}, [("x-openwebui-chat-id", "c1")]))
    assert a.key and a.key.startswith("session:") and not a.strict and a.key != b.key  # per tenant
    by_user = route_key("t", req("POST", "/v1/completions", {"prompt": "x", "user": "bob"}))
    assert by_user.key and by_user.key.startswith("session:")
    for r in (req("POST", "/v1/completions", {"prompt": "x"}), req("GET", "/v1/models"),
              req("POST", "/v1/states/import"), req("POST", "/v1/completions", b"not json"),
              req("POST", "/v1/embeddings", {"input": "x", "user": "bob"})):  # fmt: skip
        assert route_key("t", r).key is None, r.path


def test_a_forwarded_request_streams_through_the_app_and_sees_its_client_leave():
    app = FastAPI()
    left = asyncio.Event()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, object]:
        return {"got": (await request.json())["x"]}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                left.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def run():
        parts = [p async for p in run_asgi(app, req("POST", "/echo", {"x": 7}), "r0")]
        assert isinstance(parts[0], Head) and parts[0].status == 200 and parts[0].replica == "r0"
        assert json.loads(b"".join(parts[1:])) == {"got": 7}
        gen = run_asgi(app, req("GET", "/stream"), "r1")
        head = await anext(gen)
        assert head.status == 200
        assert (await anext(gen)).startswith(b"data: 0")
        await gen.aclose()  # the caller went away after one chunk
        await asyncio.wait_for(left.wait(), 5)

    asyncio.run(run())
