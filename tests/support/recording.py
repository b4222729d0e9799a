"""A proxy to real engine pools that keeps every byte it got from them: what a test compares the
client's bytes with."""

from __future__ import annotations


class Recording:
    """The proxy between the middleware and the pools, keeping every byte it got from them."""

    def __init__(self, pools: dict[str, str]) -> None:
        from ace_mw.demo.runner import proxy_app

        self.inner = proxy_app(pools)
        self.received: list[bytes] = []

    async def __call__(self, scope, receive, send):
        chunks: list[bytes] = []
        self.received.append(b"")

        async def recording(message):
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                self.received[-1] = b"".join(chunks)
            await send(message)

        await self.inner(scope, receive, recording)
