"""Gateway benchmark: what the OpenAI-compatible gateway adds to a call, against calling the
engine's own API, and how many episodes it carries to Kafka.

Run from the repository root: ``python -m bench.gateway [--agents 8] [--rounds 10]``.

The tiny chat model (``rollstream.cli.starter.save_chat_model``, its context raised to
``--context`` positions: RoPE, so no weight depends on it; its 64 hold two calls) is
served by ``producers.engine.server.ServerThread`` in a process of its own (one torch thread,
prefix cache off); a producer with the gateway on (``producers.app.run_producer``, the file
task over prompts of one length, ``rollout.engine_url`` = that engine) runs in another,
against Kafka (``--bootstrap``, else ``KAFKA_BOOTSTRAP_SERVERS``, else an embedded broker);
the agents and the direct clients share this process, one event loop.

1. **Per-call latency at ``--agents`` concurrent agents**, three sides a round:
   *gateway, openai client*: each agent opens an episode (``POST /v1/episodes``), makes
   ``--calls`` calls with the real ``openai`` client (``AsyncOpenAI``,
   ``chat.completions.create``, the episode in its ``base_url``; each history is the
   previous one plus the answer and a user reply, as a tool-using agent sends it), closes
   it with a reward and opens the next, ``--episodes`` times. Groups of ``--group-size``,
   ``--inflight`` of them admitted at once, so ``group-size x inflight`` slots (=
   ``--agents`` by default) are open together.
   *gateway, aiohttp*: the same agents send the same message lists again, in new
   episodes, as plain JSON posts with aiohttp (what the direct side's client uses): the
   gateway's own cost without the openai client's.
   *gateway, openai client, streamed*: the agents again, in new episodes, every call with
   ``stream=True`` (the gateway relays the engine's streamed ``/generate``): each call's
   time to its first text beside its time to the whole answer.
   *direct*: as many clients, each sending the engine's ``/generate`` (SGLang's native
   API, ``producers.engine.client.EngineClient``, ``return_logprob``) one call after another: the
   very token ids the gateway sent the engine for the same agent's calls (the chat
   template's rendering of its messages, checked against each answer's
   ``usage.prompt_tokens``), with the run's sampling (temperature 1, ``ignore_eos``, no
   stop tokens, ``max_new_tokens = --max-tokens``, which every gateway call asks for).
   So every side gives the engine the same work: the same prompts (the streamed side:
   prompts of the same length), exactly ``--max-tokens`` tokens a call (the engine's busy
   time per call shows it). Reported: per-call latency (median and p90 over every call of
   the measured rounds), the streamed calls' first-text latency (median and p90), each
   gateway side / direct (target <= 1.10 for the openai client's), calls in flight on
   average (sum of call latencies / wall time), CPU milliseconds per call of each
   process, how late the agents' shared event loop runs, the engine's busy time per call
   and requests per prefill batch.
2. **Episodes/s through the gateway**: a round's episodes over the time from its first
   open until the producer's ``groups_total`` (groups whose records Kafka acknowledged)
   counts all of its groups; and the rate of episodes closed alone.

Round 0 warms up and is left out; every round runs the four sides one after the other
(the openai side first: its messages are what the aiohttp and direct sides send). No
timed assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

KEY = "bench-gateway-key"
SYSTEM = "copy the first digit twice"
REPLY = "copy the first digit twice"  # the agent's "tool" answer after every turn
SEED = 3
ENGINE_COUNTERS = ("busy_s", "batches", "requests")
SETTLE_S = 0.3  # between sides: the ledger lines and the next groups' admission


# --- the two servers, each in a process of its own -----------------------------------


def _engine_process(model_dir: str, ready: Any, stop: Any) -> None:
    from core.config import default_cache_dir
    from producers.config import EngineConfig
    from producers.engine.engine import engine_from_config
    from producers.engine.server import ServerThread

    config = EngineConfig(model=model_dir, seed=0, torch_threads=1, prefix_cache_tokens=0)
    server = ServerThread(engine_from_config(config, default_cache_dir())).start()
    ready.put(server.url)
    stop.wait()
    server.stop()


def _gateway_process(spec: dict[str, Any], done: Any) -> None:
    from core.config import KafkaConfig, PresenceConfig, default_cache_dir
    from producers.app import run_producer
    from producers.config import (
        EngineConfig,
        EpisodeConfig,
        GatewayConfig,
        ProducersConfig,
        RolloutConfig,
        SamplingConfig,
    )
    from rollstream.config.settings import RollstreamConfig

    config = RollstreamConfig(
        run_id=spec["run_id"],
        state_dir=Path(spec["state_dir"]),
        cache_dir=default_cache_dir(),
        kafka=KafkaConfig(bootstrap_servers=spec["bootstrap"]),
        presence=PresenceConfig(enabled=False),
    )
    rollout = RolloutConfig(
        topic=spec["topic"],
        task="file",
        task_options={
            "path": spec["dataset"],
            "system_prompt": SYSTEM,
            "max_new_tokens": spec["max_tokens"],
        },
        group_size=spec["group_size"],
        groups=None,  # until stopped: a producer that reached its target would leave
        max_inflight_groups=spec["inflight"],
        sampling=SamplingConfig(temperature=1.0, ignore_eos=True, stop_token_ids=[]),
        episode=EpisodeConfig(max_turns=spec["calls"]),
        seed=1,
        progress=False,
        producer_id="bench-gateway",
        follow_weights=False,
        engine_url=spec["engine_url"],
        metrics_port=spec["metrics_port"],
        gateway=GatewayConfig(
            enabled=True,
            port=spec["port"],
            api_key=KEY,
            served_model_names=["policy"],
            claim_wait_s=30.0,
            idle_timeout_s=600.0,
        ),
    )
    settings = ProducersConfig(engine=EngineConfig(model=spec["model"], seed=0), rollout=rollout)
    report = asyncio.run(run_producer(config, settings, install_signals=True))
    done.put({"groups_delivered": report.groups_delivered})


def sampling_params(max_tokens: int) -> dict[str, Any]:
    """The ``sampling_params`` the gateway sends for a call of ``max_tokens`` tokens
    (``_gateway_process``'s sampling; no stop tokens, so the task's are not used)."""
    from producers.config import SamplingConfig

    return SamplingConfig(temperature=1.0, ignore_eos=True, stop_token_ids=[]).to_sglang(
        max_tokens, []
    )


def chat_model(directory: Path, context: int) -> Path:
    """The tiny chat model ``rollstream init`` writes, with ``context`` positions (its 64
    hold two calls)."""
    from rollstream.cli.starter import save_chat_model

    save_chat_model(directory, seed=SEED)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = context
    config_file.write_text(json.dumps(config, indent=2))
    return directory


def dataset(path: Path, rows: int = 64) -> Path:
    """Prompts of three digits: every one renders to the same number of tokens."""
    rng = random.Random(5)
    lines = []
    for _ in range(rows):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        row = {"messages": [{"role": "user", "content": digits}], "answer": digits[0] * 2}
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


# --- one round of each side ----------------------------------------------------------


@dataclass
class Side:
    """One side of one round: each call's latency, the wall time, CPU seconds by process."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)  # ENGINE_COUNTERS' increments
    lag_ms: float = 0.0  # how late this process's event loop ran a 5 ms timer, on average
    published_s: float = 0.0  # the gateway's: first open -> every group acknowledged by Kafka
    episodes: int = 0


@dataclass
class GatewayRound(Side):
    prompts: list[list[list[dict[str, str]]]] = field(default_factory=list)  # agent -> calls
    first_text: list[float] = field(default_factory=list)  # streamed: until the first text
    prompt_tokens: list[list[int]] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)


class Agents:
    """Each agent's HTTP clients, made once: the rollstream endpoints (open, close) with
    httpx, the calls with the ``openai`` client's own pool or with aiohttp (``plain``)."""

    def __init__(self, url: str, count: int) -> None:
        import aiohttp
        import httpx
        import openai

        self.url = url
        auth = {"Authorization": f"Bearer {KEY}"}
        self.http = [
            httpx.AsyncClient(base_url=url, headers=auth, timeout=120) for _ in range(count)
        ]
        self.openai_http = [openai.DefaultAsyncHttpxClient(timeout=120) for _ in range(count)]
        self.plain = [aiohttp.ClientSession(headers=auth) for _ in range(count)]

    async def aclose(self) -> None:
        for client in (*self.http, *self.openai_http):
            await client.aclose()
        for session in self.plain:
            await session.close()

    async def open(self, index: int) -> dict[str, Any]:
        while True:
            answer = await self.http[index].post("/v1/episodes")
            if answer.status_code == 201:
                return answer.json()
            if answer.status_code != 429:
                raise RuntimeError(f"opening an episode: {answer.status_code} {answer.text}")
            await asyncio.sleep(float(answer.headers.get("Retry-After", "1")))

    async def close(self, index: int, episode_id: str, reward: float) -> None:
        closed = await self.http[index].post(
            f"/v1/episodes/{episode_id}/close", json={"reward": reward}
        )
        if closed.status_code != 200:
            raise RuntimeError(f"closing an episode: {closed.status_code} {closed.text}")


async def gateway_round(
    agents: Agents,
    args: argparse.Namespace,
    rng: random.Random,
    published: Any,
    probe: Probe,
    replay: list[list[list[dict[str, str]]]] | None = None,
    *,
    stream: bool = False,
) -> GatewayRound:
    """``args.agents`` agents, ``args.episodes`` episodes of ``args.calls`` calls each,
    with the ``openai`` client (``stream``: streamed, each call's time to its first text
    kept too); with ``replay`` (each agent's message lists of an earlier round), those
    messages are sent again with aiohttp, in new episodes. ``published()`` returns once
    the producer acknowledged this round's groups."""
    import openai

    out = GatewayRound(prompts=[[] for _ in range(args.agents)])
    out.prompt_tokens = [[] for _ in range(args.agents)]
    rewards = [rng.random() for _ in range(args.agents * args.episodes)]

    async def call(index: int, base: str, messages: list[dict[str, str]]) -> str:
        body = {"model": "policy", "messages": messages, "max_tokens": args.max_tokens}
        began = time.perf_counter()
        if replay is None:
            client = openai.AsyncOpenAI(
                base_url=base, api_key=KEY, max_retries=0, http_client=agents.openai_http[index]
            )
            if stream:
                text, usage = await _streamed(client, body, out, began)
            else:
                answer = await client.chat.completions.create(**body)
                usage, text = answer.usage, answer.choices[0].message.content
            prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
        else:
            async with agents.plain[index].post(base + "/chat/completions", json=body) as got:
                if got.status != 200:
                    raise RuntimeError(f"a call: {got.status} {await got.text()}")
                data = await got.json()
            text = data["choices"][0]["message"]["content"]
            prompt_tokens = data["usage"]["prompt_tokens"]
            completion_tokens = data["usage"]["completion_tokens"]
        out.latencies.append(time.perf_counter() - began)
        out.prompts[index].append(messages)
        out.prompt_tokens[index].append(prompt_tokens)
        out.completion_tokens.append(completion_tokens)
        return text or ""

    async def agent(index: int) -> None:
        for episode in range(args.episodes):
            opened = await agents.open(index)
            base = agents.url + opened["base_url_path"]
            example = opened["prompt"]["metadata"]["example"]
            messages = [{"role": "system", "content": SYSTEM}, *example["messages"]]
            for turn in range(args.calls):
                if replay is not None:
                    messages = replay[index][episode * args.calls + turn]
                text = await call(index, base, messages)
                messages = [
                    *messages,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": REPLY},
                ]
            await agents.close(
                index, opened["episode_id"], rewards[index * args.episodes + episode]
            )

    async with Watch(out, probe) as watch:
        await asyncio.gather(*(agent(i) for i in range(args.agents)))
    await published()
    out.published_s = time.perf_counter() - watch.began
    out.episodes = args.agents * args.episodes
    await asyncio.sleep(SETTLE_S)  # the producer's work after the acknowledgements
    return out


async def _streamed(
    client: Any, body: dict[str, Any], out: GatewayRound, began: float
) -> tuple[str, Any]:
    """A streamed call's text and usage; the time to its first text goes to ``out``."""
    pieces: list[str] = []
    usage = None
    calls = await client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in calls:
        usage = chunk.usage or usage
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            if not pieces:
                out.first_text.append(time.perf_counter() - began)
            pieces.append(piece)
    if usage is None:
        raise RuntimeError("a streamed call without its usage chunk")
    return "".join(pieces), usage


async def direct_round(
    clients: Sequence[Any],
    prompts: Sequence[Sequence[list[int]]],
    params: dict[str, Any],
    probe: Probe,
) -> Side:
    """One ``EngineClient`` per agent, each sending that agent's prompts one after
    another."""
    out = Side()
    lengths: list[int] = []

    async def client(engine: Any, ids_list: Sequence[list[int]]) -> None:
        for ids in ids_list:
            began = time.perf_counter()
            (result,) = await engine.generate([ids], params, return_logprob=True)
            out.latencies.append(time.perf_counter() - began)
            lengths.append(len(result.output_ids))

    async with Watch(out, probe):
        await asyncio.gather(*(client(c, p) for c, p in zip(clients, prompts, strict=True)))
    if set(lengths) != {params["max_new_tokens"]}:
        print(f"  note: direct calls generated {sorted(set(lengths))} tokens", flush=True)
    return out


# --- measuring -----------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """Where a side's costs are read: CPU seconds of this process and of the servers'
    (``pids``), and the engine's own counters (busy seconds, batches, requests)."""

    pids: dict[str, int]
    engine_url: str

    def read(self) -> dict[str, float]:
        from bench.e2e import process_cpu_s

        usage = resource.getrusage(resource.RUSAGE_SELF)
        out = {"clients": usage.ru_utime + usage.ru_stime}
        for name, pid in self.pids.items():
            out[name] = process_cpu_s(pid) or 0.0
        with urllib.request.urlopen(self.engine_url + "/get_server_info", timeout=10) as got:
            info = json.loads(got.read())
        for key in ENGINE_COUNTERS:
            out[key] = float(info[key])
        return out


class Watch:
    """Around one side's calls: their wall time, the CPU seconds each process spent, and
    how late this process's event loop ran a timer due every 5 ms (the agents share the
    loop: a late timer is an answer that waits for the other agents' client work)."""

    def __init__(self, side: Side, probe: Probe, interval_s: float = 0.005) -> None:
        self.side, self.probe, self.interval_s = side, probe, interval_s
        self.lags: list[float] = []

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lags.append(loop.time() - due)

    async def __aenter__(self) -> Watch:
        self.before = await asyncio.to_thread(self.probe.read)
        self.began = time.perf_counter()
        self.ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.side.wall_s = time.perf_counter() - self.began
        self.ticker.cancel()
        after = await asyncio.to_thread(self.probe.read)
        spent = {name: after[name] - self.before[name] for name in after}
        self.side.engine = {key: spent.pop(key) for key in ENGINE_COUNTERS}
        self.side.cpu_s = spent
        self.side.lag_ms = 1e3 * statistics.fmean(self.lags) if self.lags else 0.0


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids the gateway generates from for ``messages`` (``Gateway._render``)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _machine() -> str:
    """The CPU model, its cores and the memory, from ``/proc``."""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if "model name" in line),
        "unknown CPU",
    )
    kb = next((int(line.split()[1]) for line in _lines("/proc/meminfo") if "MemTotal" in line), 0)
    return f"{os.cpu_count()} cores ({cpu}), {kb / 2**20:.0f} GB"


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


SIDES = {
    "direct": "direct, EngineClient -> /generate",
    "gateway": "gateway, openai client",
    "plain": "gateway, aiohttp (same messages)",
    "stream": "gateway, openai client, streamed",
}
GATEWAY_SIDES = ("gateway", "plain", "stream")


async def measure(
    args: argparse.Namespace,
    gateway_url: str,
    engine_url: str,
    metrics_port: int,
    probe: Probe,
    tokenizer: Any,
) -> tuple[dict[str, list[Side]], dict[str, int]]:
    """Every round: the gateway with the openai client, the same messages with aiohttp,
    then their prompts sent to the engine directly."""
    from producers.engine.client import EngineClient
    from rollstream.up.display import scrape

    groups_per_round = args.agents * args.episodes // args.group_size
    params = sampling_params(args.max_tokens)
    rng = random.Random(0)
    sides: dict[str, list[Side]] = {name: [] for name in SIDES}
    checks = {"calls": 0, "prompt_tokens_differ": 0, "short_answers": 0}
    metrics: dict[str, float] = {}
    delivered = 0

    async def published() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics.update(await asyncio.to_thread(scrape, metrics_port, 2.0))
            if metrics.get("rollstream_producer_groups_total", 0.0) >= delivered:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"the producer did not publish {delivered} groups within 120 s")

    agents = Agents(gateway_url, args.agents)
    engines = [EngineClient(engine_url, retries=0) for _ in range(args.agents)]
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            found: dict[str, Side] = {}
            for name in GATEWAY_SIDES:
                delivered += groups_per_round
                replay = found["gateway"].prompts if name == "plain" else None
                side = await gateway_round(
                    agents, args, rng, published, probe, replay, stream=name == "stream"
                )
                checks["short_answers"] += sum(n != args.max_tokens for n in side.completion_tokens)
                found[name] = side
            recorded = found["gateway"]
            prompts = [[render(tokenizer, m) for m in agent] for agent in recorded.prompts]
            for side in (found["gateway"], found["plain"]):
                for ids_list, counted in zip(prompts, side.prompt_tokens, strict=True):
                    checks["calls"] += len(ids_list)
                    checks["prompt_tokens_differ"] += sum(
                        len(ids) != n for ids, n in zip(ids_list, counted, strict=True)
                    )
            found["direct"] = await direct_round(engines, prompts, params, probe)
            medians = ", ".join(
                f"{name} {statistics.median(side.latencies) * 1e3:.1f} ms"
                for name, side in found.items()
            )
            print(
                f"  round {round_}{' (warm-up)' if round_ == 0 else ''}: per call {medians}; "
                f"{recorded.episodes / recorded.published_s:.1f} episodes/s",
                flush=True,
            )
            if round_ > 0:
                for name, side in found.items():
                    sides[name].append(side)
    finally:
        await agents.aclose()
        for engine in engines:
            await engine.aclose()
    checks["splits"] = int(
        sum(
            v
            for k, v in metrics.items()
            if k.startswith("rollstream_producer_gateway_history_mismatches_total")
        )
    )
    return sides, checks


def report(
    args: argparse.Namespace,
    sides: dict[str, list[Side]],
    checks: dict[str, int],
    final: dict[str, Any],
) -> None:
    calls = {name: [x for r in rounds for x in r.latencies] for name, rounds in sides.items()}
    median = {name: statistics.median(values) for name, values in calls.items()}
    print(
        f"\n# bench.gateway {datetime.now(UTC):%Y-%m-%d}, {_machine()}; tiny chat "
        f"model (context {args.context}, one torch thread, prefix cache off); {args.agents} "
        f"agents, groups of {args.group_size}, {args.inflight} in flight; {args.episodes} "
        f"episodes of {args.calls} calls per agent a round, max_tokens {args.max_tokens}; "
        f"{args.rounds} rounds after a warm-up, {len(calls['direct'])} calls a side"
    )
    print(
        "1. per-call latency; CPU ms per call of this process (agents or clients), the "
        "producer, the engine; how late the agents' event loop runs; the engine's busy "
        "time per call and requests per prefill batch"
    )
    for name, values in calls.items():
        rounds = sides[name]
        in_flight = statistics.median(sum(r.latencies) / r.wall_s for r in rounds)
        cpu = {
            proc: statistics.median(r.cpu_s[proc] / len(r.latencies) for r in rounds) * 1e3
            for proc in rounds[0].cpu_s
        }
        lag = statistics.median(r.lag_ms for r in rounds)
        busy = statistics.median(r.engine["busy_s"] / len(r.latencies) for r in rounds) * 1e3
        batch = statistics.median(r.engine["requests"] / r.engine["batches"] for r in rounds)
        print(
            f"  {SIDES[name]:34s} median {median[name] * 1e3:5.1f} ms  p90 "
            f"{_percentile(values, 0.9) * 1e3:5.1f} ms  in flight {in_flight:.1f}  CPU "
            + " / ".join(f"{ms:.1f}" for ms in cpu.values())
            + f"  loop lag {lag:.1f} ms  engine busy {busy:.1f} ms, {batch:.1f} requests a batch"
        )
    for name in GATEWAY_SIDES:
        ratio = median[name] / median["direct"]
        per_round = [
            statistics.median(g.latencies) / statistics.median(d.latencies)
            for g, d in zip(sides[name], sides["direct"], strict=True)
        ]
        verdict = f"; target <= 1.10: {'met' if ratio <= 1.10 else 'missed'}"
        print(
            f"  {SIDES[name]} / direct: {ratio:.2f} (rounds {min(per_round):.2f}-"
            f"{max(per_round):.2f}){verdict if name == 'gateway' else ''}"
        )
    first = [x for r in sides["stream"] for x in r.first_text]  # type: ignore[attr-defined]
    print(
        f"  streamed: first text median {statistics.median(first) * 1e3:.1f} ms (p90 "
        f"{_percentile(first, 0.9) * 1e3:.1f} ms) against the whole answer's "
        f"{median['stream'] * 1e3:.1f} ms streamed and {median['gateway'] * 1e3:.1f} ms not "
        f"({len(first)} of {len(calls['stream'])} streamed calls had text)"
    )
    print(
        f"  same engine work: {checks['calls'] - checks['prompt_tokens_differ']} of "
        f"{checks['calls']} gateway calls (warm-up included) had usage.prompt_tokens equal "
        f"to the replayed prompt's length; "
        f"{checks['short_answers']} gateway answers short of {args.max_tokens} tokens; "
        f"{checks['splits']} history splits (an answer's text re-renders to other tokens)"
    )
    print(f"2. episodes/s (opened -> {args.calls} calls -> closed -> group acknowledged by Kafka)")
    for name in GATEWAY_SIDES:
        rounds = sides[name]
        closed = statistics.median(r.episodes / r.wall_s for r in rounds)
        done = statistics.median(r.episodes / r.published_s for r in rounds)
        print(f"  {SIDES[name]:34s} {done:5.1f} episodes/s (closed alone {closed:.1f})")
    print(
        f"  {args.agents * args.episodes} episodes a round; the producer delivered "
        f"{final.get('groups_delivered', '?')} groups, {final.get('records', '?')} records"
    )


# --- main ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8, help="concurrent agents / clients")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=2, help="max_inflight_groups")
    parser.add_argument("--episodes", type=int, default=4, help="episodes per agent a round")
    parser.add_argument("--calls", type=int, default=4, help="calls per episode")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--context", type=int, default=256, help="the model's positions")
    parser.add_argument("--bootstrap", help="Kafka host:port (default: an embedded broker)")
    args = parser.parse_args(argv)
    if args.agents * args.episodes % args.group_size:
        parser.error("agents x episodes must be a multiple of --group-size")

    from core.config import KafkaConfig, default_cache_dir
    from core.process import free_port
    from core.topic_reader import end_offsets
    from infra.topics import ensure_topics
    from schemas.topics import TopicSpec

    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as scratch:
        work = Path(scratch)
        broker = None
        bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            from infra.kafka import EmbeddedKafka

            broker = EmbeddedKafka(KafkaConfig(), work / "kafka", default_cache_dir())
            bootstrap = broker.start()
        engine = gateway = None
        stop_engine = spawn.Event()
        try:
            client_config = KafkaConfig(bootstrap_servers=bootstrap).client_config()
            topic = f"bench.gateway-{uuid.uuid4().hex[:8]}"
            ensure_topics(client_config, [TopicSpec(topic, partitions=1)])
            model = chat_model(work / "model", args.context)
            ready = spawn.Queue()
            engine = spawn.Process(target=_engine_process, args=(str(model), ready, stop_engine))
            engine.start()
            engine_url = ready.get(timeout=180)
            port, metrics_port = free_port(), free_port()
            spec = {
                "run_id": f"bench-gateway-{uuid.uuid4().hex[:6]}",
                "state_dir": str(work / "state"),
                "bootstrap": bootstrap,
                "topic": topic,
                "dataset": str(dataset(work / "train.jsonl")),
                "model": str(model),
                "engine_url": engine_url,
                "port": port,
                "metrics_port": metrics_port,
                "max_tokens": args.max_tokens,
                "group_size": args.group_size,
                "inflight": args.inflight,
                "calls": args.calls,
            }
            done = spawn.Queue()
            gateway = spawn.Process(target=_gateway_process, args=(spec, done))
            gateway.start()
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, gateway)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
            probe = Probe({"gateway": gateway.pid, "engine": engine.pid}, engine_url)
            print(f"engine {engine_url}, gateway {url}, topic {topic}", flush=True)
            sides, checks = asyncio.run(
                measure(args, url, engine_url, metrics_port, probe, tokenizer)
            )
            gateway.terminate()  # SIGTERM: the worker stops, its unclaimed groups abandoned
            final = done.get(timeout=120)
            gateway.join(60)
            final["records"] = sum(end_offsets(client_config, topic).values())
            report(args, sides, checks, final)
        finally:
            for process in (gateway, engine):
                if process is not None and process.is_alive():
                    if process is engine:
                        stop_engine.set()
                        process.join(30)
                    if process.is_alive():
                        process.terminate()
                        process.join(30)
            if broker is not None:
                broker.stop()


def _wait_healthy(url: str, process: Any, timeout_s: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise RuntimeError("the gateway's producer exited before serving")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway did not answer /health within {timeout_s:.0f} s")


if __name__ == "__main__":
    main()
