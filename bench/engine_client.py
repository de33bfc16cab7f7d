"""Engine client transport: ``python -m bench.engine_client [--in-flight 100] [--repeats 5]``.

A producer keeps many ``/generate`` requests in flight to one engine (every sample of every
group in flight, every turn of every episode). This measures what the client itself costs
per request at that concurrency: the real ``EngineClient`` (aiohttp) against a bare httpx
``AsyncClient`` with the limits the client used before, both calling a local server that
answers a valid SGLang response after ``--latency-ms`` (so the engine costs nothing and the
figure is the client's). The server runs in its own process; the client's CPU time is the
process's own (``getrusage``). Runs alternate between the two so that load from other
processes hits both alike. Figures: requests/s and client CPU ms per request, medians over
repeats, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from aiohttp import web

from core.process import free_port
from producers.engine.client import EngineClient

PROMPT = list(range(50))
NEW_TOKENS = 8


def _answer() -> dict[str, object]:
    ids = list(range(NEW_TOKENS))
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": NEW_TOKENS},
            "prompt_tokens": len(PROMPT),
            "completion_tokens": NEW_TOKENS,
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "weight_version": "0",
        },
    }


def _serve(port: int, latency_s: float) -> None:
    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(latency_s)
        return web.json_response(_answer())

    app = web.Application()
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


@dataclass
class Figure:
    requests_per_s: float
    cpu_ms_per_request: float


async def _drive(call: Callable[[], Awaitable[object]], in_flight: int, requests: int) -> Figure:
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < requests:
            sent += 1
            await call()

    before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Figure(requests / wall, 1000.0 * cpu / requests)


async def _engine_client(url: str, in_flight: int, requests: int) -> Figure:
    async with EngineClient(url) as client:
        return await _drive(
            lambda: client.generate([PROMPT], {"max_new_tokens": NEW_TOKENS}), in_flight, requests
        )


async def _httpx(url: str, in_flight: int, requests: int) -> Figure:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    body = {"input_ids": [PROMPT], "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:

        async def call() -> object:
            return (await client.post("/generate", json=body)).json()

        return await _drive(call, in_flight, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=100, help="Concurrent requests.")
    parser.add_argument("--requests", type=int, default=2000, help="Requests per run.")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="Server answer delay.")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.Process(target=_serve, args=(port, args.latency_ms / 1000.0))
    server.start()
    url = f"http://127.0.0.1:{port}"
    time.sleep(1.5)
    try:
        runs: dict[str, list[Figure]] = {"EngineClient (aiohttp)": [], "httpx AsyncClient": []}
        for _ in range(args.repeats):
            runs["EngineClient (aiohttp)"].append(
                asyncio.run(_engine_client(url, args.in_flight, args.requests))
            )
            runs["httpx AsyncClient"].append(
                asyncio.run(_httpx(url, args.in_flight, args.requests))
            )
    finally:
        server.terminate()
        server.join()
    print(
        f"engine client: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; "
        f"{args.in_flight} requests in flight, server latency {args.latency_ms:.0f} ms, "
        f"medians of {args.repeats}"
    )
    medians = {}
    for name, figures in runs.items():
        rate = statistics.median(f.requests_per_s for f in figures)
        cpu = statistics.median(f.cpu_ms_per_request for f in figures)
        medians[name] = (rate, cpu)
        print(f"  {name:24s} {rate:8.0f} requests/s  {cpu:6.2f} ms CPU per request")
    (ours_rate, ours_cpu), (base_rate, base_cpu) = medians.values()
    print(f"  ratio: {ours_rate / base_rate:.1f}x requests/s, {base_cpu / ours_cpu:.1f}x less CPU")


if __name__ == "__main__":
    main()
