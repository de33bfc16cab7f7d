"""Producer benchmarks: ``python -m bench.producers [--model tiny] [--repeats 15]``.

1. **Engine server vs in-process.** Tokens/s of the same model (same weights, sampling,
   log-probs on, EOS ignored so every call makes ``--new-tokens`` tokens) called
   in-process (``Engine.generate`` in the caller's thread) and through the HTTP server, run
   as ``python -m producers serve`` in its own process as deployed, with the real
   ``EngineClient`` (request, scheduler queue, batching window, JSON, response checks).
   Batch 1; batch 8 as one request (how the worker sends a group); batch 8 as 8 concurrent
   requests (the scheduler batches them). Runs alternate between the paths so that load
   from other processes hits both alike. Target: server >= 0.85x in-process.
2. **Publish overhead.** The real ``RolloutWorker`` with an in-process engine delivers
   ``--groups`` groups of G=8 to a real Kafka broker (``--bootstrap``, else
   ``KAFKA_BOOTSTRAP_SERVERS``, else an embedded broker is started). Per group it times
   generation (all G samples) and publishing on the event loop (encode, ledger line,
   produce), the fsync of the ledger line (done in a thread, off the loop), and the
   record building (reward, ``Trajectory.create``, validation); once with the ledger's
   ``pending`` line fsynced (the default) and once flushed only.
   Target: publish / generation < 2%.

Every figure is a median over repeats of one run; ratios are ratios of medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from core.models import load_model, load_tokenizer, parse_model_spec


def _median(values: list[float]) -> float:
    return statistics.median(values)


def bench_engine(model: str, repeats: int, new_tokens: int, threads: int) -> None:
    import httpx

    from core.config import default_cache_dir
    from producers.engine.client import EngineClient
    from producers.engine.engine import Engine
    from producers.engine.requests import SamplingParams

    spec = parse_model_spec(model)
    loaded = load_model(spec, cache_dir=default_cache_dir())
    engine = Engine(loaded, model_path=spec.name, seed=0)  # in-process
    prompt = _prompt(model, load_tokenizer(spec, default_cache_dir()))
    new_tokens = min(new_tokens, engine.context_length - len(prompt))
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    wire = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    rates: dict[str, list[float]] = {
        k: [] for k in ("inproc-1", "server-1", "inproc-8", "server-8", "server-8x1")
    }

    async def measure(client: EngineClient) -> None:
        async def concurrent() -> None:
            await asyncio.gather(*(client.generate([prompt], wire) for _ in range(8)))

        steps = [
            ("inproc-1", 1, lambda: _sync(engine.generate([prompt], params))),
            ("server-1", 1, lambda: client.generate([prompt], wire)),
            ("inproc-8", 8, lambda: _sync(engine.generate([prompt] * 8, params))),
            ("server-8", 8, lambda: client.generate([prompt] * 8, wire)),
            ("server-8x1", 8, concurrent),
        ]
        for _, _, call in steps:  # warm-up
            await call()
        for _ in range(repeats):
            for name, batch, call in steps:
                began = time.perf_counter()
                await call()
                rates[name].append(batch * new_tokens / (time.perf_counter() - began))

    with _server_process(model, threads) as url:
        asyncio.run(_with_client(url, measure))
        info = httpx.get(url + "/get_server_info").json()
    m = {k: _median(v) for k, v in rates.items()}
    print(f"engine: {model}, {new_tokens} new tokens per sequence, {repeats} repeats (medians);")
    print("  server = `python -m producers serve` in its own process, called with EngineClient")
    for label, key, note in (
        ("batch 1", "server-1", ""),
        ("batch 8", "server-8", "  (one request of 8)"),
        ("batch 8", "server-8x1", "  (8 concurrent requests)"),
    ):
        base = m["inproc-1" if key == "server-1" else "inproc-8"]
        print(
            f"  {label}   in-process {base:8.1f} tok/s   server {m[key]:8.1f} tok/s"
            f"   ratio {m[key] / base:.3f}{note}"
        )
    print(f"  server scheduler: {info['batches']} batches for {info['requests']} requests")


@contextlib.contextmanager
def _server_process(model: str, threads: int):
    """``python -m producers serve`` on a free port; yields its URL."""
    settings = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "rollstream.toml"
    settings.write_text(
        f'[producers.engine]\nmodel = "{model}"\nport = 0\nseed = 0\ntorch_threads = {threads}\n'
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "producers", "serve", "--config", str(settings)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        for line in process.stdout:
            if " at http://" in line:
                url = line.rsplit(" at ", 1)[1].strip()
                break
        if url is None:
            raise RuntimeError("the engine server did not start")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


async def _sync(value: object) -> object:
    return value


async def _with_client(url: str, body) -> None:
    from producers.engine.client import EngineClient

    async with EngineClient(url) as client:
        await body(client)


def _prompt(model: str, tokenizer) -> list[int]:
    if parse_model_spec(model).is_tiny:
        return [1, 6, 7, 8, 3]  # BOS 1 2 3 SEP
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 12 apples and gets 7 more. How many now?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def bench_publish(model: str, groups: int, bootstrap: str | None, threads: int) -> None:
    from core.config import KafkaConfig, default_cache_dir
    from infra.kafka import EmbeddedKafka
    from infra.topics import ensure_topics
    from producers.config import EngineConfig
    from producers.engine.engine import engine_from_config
    from schemas.topics import TopicSpec

    workdir = Path(tempfile.mkdtemp(prefix="bench-producers-"))
    broker = None
    bootstrap = bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        broker = EmbeddedKafka(KafkaConfig(), workdir / "kafka", default_cache_dir())
        bootstrap = broker.start()
    try:
        client_config = KafkaConfig(bootstrap_servers=bootstrap).client_config()
        topic = f"bench.rollouts.raw-{uuid.uuid4().hex[:8]}"
        ensure_topics(client_config, [TopicSpec(topic, partitions=8)])
        engine_config = EngineConfig(model=model, seed=0, torch_threads=threads)
        engine = engine_from_config(engine_config, default_cache_dir())
        try:
            for fsync in (True, False):
                _publish_run(engine, model, groups, client_config, topic, workdir, fsync)
        finally:
            engine.shutdown()
    finally:
        if broker is not None:
            broker.stop()


def _publish_run(engine, model, groups, client_config, topic, workdir, fsync: bool) -> None:
    from core.config import default_cache_dir
    from producers.config import RolloutConfig
    from producers.engine.backends import LocalBackend
    from producers.rollout.group_publisher import GroupPublisher
    from producers.rollout.ledger import Ledger
    from producers.rollout.metrics import ProducerMetrics
    from producers.rollout.publishing import Outbox, ProducerIdentity
    from producers.rollout.worker import RolloutWorker
    from producers.tasks.base import TaskContext
    from producers.tasks.catalog import make_task

    tiny = parse_model_spec(model).is_tiny
    task_name = "copy-first-digit-twice" if tiny else "arithmetic"
    task = make_task(task_name, {}, TaskContext(default_cache_dir(), engine.tokenizer))
    metrics = ProducerMetrics()
    ledger = Ledger(workdir / f"ledger-{fsync}", fsync=fsync).open()
    publisher = GroupPublisher(client_config, topic, ledger, metrics)
    config = RolloutConfig(
        task=task_name, group_size=8, max_inflight_groups=1, seed=0, progress=False
    )
    worker = RolloutWorker(
        config,
        LocalBackend(engine),
        task,
        Outbox(publisher),
        ProducerIdentity(run_id="bench", producer_id="bench", region="local"),
    )
    timings: dict[str, list[float]] = {
        "generate": [],
        "prepare": [],
        "send": [],
        "sync": [],
        "build": [],
    }
    tokens: list[int] = []
    worker.generator.group = _timed(worker.generator.group, timings["generate"], tokens)
    worker.records.trajectory = _timed_sync(worker.records.trajectory, timings["build"])
    publisher.prepare = _timed_sync(publisher.prepare, timings["prepare"])
    publisher.send = _timed_sync(publisher.send, timings["send"])
    ledger.sync = _timed_sync(ledger.sync, timings["sync"])
    report = asyncio.run(worker.run(groups))
    publisher.close()
    ledger.close()
    gen = _median(timings["generate"])
    per_group = [p + s for p, s in zip(timings["prepare"], timings["send"], strict=True)]
    pub = _median(per_group)
    build = _median(timings["build"]) * 8
    if fsync:
        print(
            f"publish: {model}, task {task_name}, {report.groups_delivered} groups of 8 per run "
            "delivered to Kafka (medians per group); publish = encode + ledger line + produce "
            "on the event loop"
        )
    label = "ledger fsynced (default)" if fsync else "ledger flushed, no fsync"
    print(
        f"  {label:<25} generation {gen * 1e3:7.2f} ms ({_median(tokens):.0f} tokens)   "
        f"publish {pub * 1e3:6.3f} ms = {pub / gen:.2%}   "
        f"build {build * 1e3:6.3f} ms = {build / gen:.2%}"
    )
    if fsync:
        print(
            f"  {'':<25} fsync of the pending line {_median(timings['sync']) * 1e3:6.3f} ms, "
            "in a thread (the loop keeps generating other groups meanwhile)"
        )


def _timed(fn, sink: list[float], tokens: list[int]):
    async def wrapper(*args, **kwargs):
        began = time.perf_counter()
        samples = await fn(*args, **kwargs)
        sink.append(time.perf_counter() - began)
        tokens.append(sum(len(s.response_ids) for s in samples))
        return samples

    return wrapper


def _timed_sync(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        result = fn(*args, **kwargs)
        sink.append(time.perf_counter() - began)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="Model spec (core.models).")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--bootstrap", help="Kafka host:port (default: embedded broker)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-publish", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_engine:
        bench_engine(args.model, args.repeats, args.new_tokens, args.threads)
    if not args.skip_publish:
        bench_publish(args.model, args.groups, args.bootstrap, args.threads)


if __name__ == "__main__":
    main()
