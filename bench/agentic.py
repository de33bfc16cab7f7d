"""Agentic benchmark: what a multi-turn episode costs against one-shot generation.

Run from the repository root: ``python -m bench.agentic [--model tiny|smollm2-135m]``.

1. **Multi-turn overhead.** ``--episodes`` episodes of ``--turns`` policy turns of
   ``--turn-tokens`` tokens each, separated by environment observations of
   ``--obs-tokens`` tokens, on the CPU engine (``producers.engine.engine``): every
   turn is one generate call with the whole history, as the producer sends it. Against
   one-shot generation of the same number of policy tokens (one call of
   ``turns x turn-tokens`` tokens). Measured with the engine's prefix cache (a turn
   prefills only the new tokens) and without (every turn prefills the whole history).
   Target: multi-turn / one-shot ≤ 1.3 with the prefix cache. What the cache costs a
   single-turn workload (its KV copied out of every finished request, a lookup at every
   prefill) is the one-shot time with the cache against without it.
2. **Old-logit cost per policy token.** The stream's old-logit pass
   (``streams.oldlogits`` batching, ``core.logprobs.response_logprobs``) over the
   episodes as records (policy and environment tokens), against single-turn records with
   the same number of policy tokens. The environment's tokens are context the pass must
   run over, so the ratio is about (policy + environment) / policy tokens. Target ≤ 1.2.

Figures are medians over ``--rounds`` rounds, both sides of a ratio measured in the same
round; one torch thread. On a shared 2-core machine expect ±10% noise.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import torch

from core.logprobs import response_logprobs
from core.models import load_model, parse_model_spec
from producers.engine.engine import Engine, Scheduling
from producers.engine.requests import SamplingParams


def _engine(model: str, prefix_cache_tokens: int) -> Engine:
    spec = parse_model_spec(model)
    return Engine(
        load_model(spec, "float32"),
        model_path=spec.name,
        seed=0,
        scheduling=Scheduling(prefix_cache_tokens=prefix_cache_tokens, max_batch_size=64),
    )


def _prompts(episodes: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(episodes)]


def multi_turn(
    engine: Engine,
    prompts: Sequence[list[int]],
    turns: int,
    turn_tokens: int,
    obs_tokens: int,
    rng: random.Random,
) -> tuple[float, list[list[int]], list[list[int]]]:
    """Seconds for the episodes, their responses, and the positions of their policy
    tokens."""
    params = SamplingParams(max_new_tokens=turn_tokens, ignore_eos=True)
    histories = [list(p) for p in prompts]
    policy_positions: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    for turn in range(turns):
        results = engine.generate(histories, params)
        for row, result in enumerate(results):
            start = len(histories[row]) - len(prompts[row])
            policy_positions[row] += range(start, start + len(result.output_ids))
            histories[row] += result.output_ids
            if turn + 1 < turns:
                histories[row] += [rng.randrange(3, engine.vocab_size) for _ in range(obs_tokens)]
    seconds = time.perf_counter() - started
    responses = [h[len(p) :] for h, p in zip(histories, prompts, strict=True)]
    return seconds, responses, policy_positions


def one_shot(engine: Engine, prompts: Sequence[list[int]], tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    results = engine.generate(list(prompts), params)
    return time.perf_counter() - started, [r.output_ids for r in results]


def old_logit_seconds(model, prompts, responses, batch: int = 16) -> float:
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        pairs = list(zip(prompts[i : i + batch], responses[i : i + batch], strict=True))
        response_logprobs(model, pairs, torch.float32)
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:max_positions=512")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--obs-tokens", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    cached, uncached = _engine(args.model, 1 << 16), _engine(args.model, 0)
    uncached.model.load_state_dict(cached.model.state_dict())
    scorer = cached.model
    vocab = min(cached.vocab_size, 32_000)
    policy_tokens = args.turns * args.turn_tokens
    keys = ("one", "one_nocache", "multi", "multi_nocache", "ol_m", "ol_s")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        rng = random.Random(round_)
        prompts = _prompts(args.episodes, args.prompt_tokens, vocab, rng)
        one, single = one_shot(cached, prompts, policy_tokens)
        one_nocache, _ = one_shot(uncached, prompts, policy_tokens)
        cached.prefix_cache.clear()  # type: ignore[union-attr]
        multi, responses, _ = multi_turn(
            cached, prompts, args.turns, args.turn_tokens, args.obs_tokens, random.Random(1)
        )
        nocache, _, _ = multi_turn(
            uncached, prompts, args.turns, args.turn_tokens, args.obs_tokens, random.Random(1)
        )
        ol_multi = old_logit_seconds(scorer, prompts, responses)
        ol_single = old_logit_seconds(scorer, prompts, single)
        if round_ == 0:
            continue
        values = (one, one_nocache, multi, nocache, ol_multi, ol_single)
        for key, value in zip(rows, values, strict=True):
            rows[key].append(value)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"# bench.agentic {datetime.now(UTC):%Y-%m-%d} model={args.model} "
        f"episodes={args.episodes} turns={args.turns}x{args.turn_tokens} "
        f"obs={args.obs_tokens} prompt={args.prompt_tokens} rounds={args.rounds}"
    )
    total = args.episodes * policy_tokens
    print(f"one-shot generation        {med['one']:.3f} s  ({total / med['one']:.0f} policy tok/s)")
    print(
        f"one-shot, no prefix cache  {med['one_nocache']:.3f} s  "
        f"(cache on / off {med['one'] / med['one_nocache']:.2f})"
    )
    print(f"multi-turn, prefix cache   {med['multi']:.3f} s  ratio {med['multi'] / med['one']:.2f}")
    print(
        f"multi-turn, no reuse       {med['multi_nocache']:.3f} s  "
        f"ratio {med['multi_nocache'] / med['one']:.2f}"
    )
    print(
        f"old logits per policy token: multi-turn / single-turn "
        f"{med['ol_m'] / med['ol_s']:.2f}  ({med['ol_m']:.3f} s vs {med['ol_s']:.3f} s)"
    )


if __name__ == "__main__":
    main()
