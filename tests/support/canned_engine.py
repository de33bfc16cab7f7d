"""A stand-in engine for the producer's client: a real HTTP server (aiohttp, on
127.0.0.1) answering ``/generate`` with canned bodies, most of them broken on purpose."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from aiohttp import web

from core.process import free_port


class FakeEngine:
    """A real HTTP server answering /generate with canned (mostly broken) bodies."""

    def __init__(self, replies: list[tuple[int, object]]) -> None:
        self.replies = list(replies)
        self.calls = 0
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/")
                break
            except httpx.TransportError:
                time.sleep(0.02)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._loop.run_forever()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        status, body = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        if isinstance(body, bytes):  # server-sent events, cut off unless they end in [DONE]
            stream = web.StreamResponse(status=status)
            stream.content_type = "text/event-stream"
            await stream.prepare(request)
            await stream.write(body)
            if b"[DONE]" in body:
                await stream.write_eof()
            else:
                assert request.transport is not None
                request.transport.abort()
            return stream
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()


def good_reply(ids=(7, 8), logprobs=(-0.5, -1.0)) -> dict:
    """A well-formed `/generate` answer of one request, in SGLang's fields."""
    return {
        "text": "",
        "output_ids": list(ids),
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": len(ids)},
            "prompt_tokens": 5,
            "completion_tokens": len(ids),
            "weight_version": "3",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        },
    }
