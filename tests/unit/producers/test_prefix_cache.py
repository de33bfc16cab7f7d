"""The engine's prefix cache: a request extending a finished one prefills only its new
tokens, and its log-probs are those of a plain forward pass over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from core.models import BOS_ID, SEP_ID, build_tiny_llama
from producers.engine.engine import Engine, Scheduling
from producers.engine.prefix_cache import PrefixCache
from producers.engine.requests import SamplingParams

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def recompute(model, prompt: list[int], response: list[int]) -> list[float]:
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), -1)
    start = len(prompt) - 1
    return [float(logp[start + i, token]) for i, token in enumerate(response)]


def make_engine(prefix_cache_tokens: int) -> Engine:
    return Engine(
        build_tiny_llama(seed=0),
        model_path="tiny",
        seed=1,
        scheduling=Scheduling(prefix_cache_tokens=prefix_cache_tokens),
    ).start()


def test_turns_of_an_episode_reuse_the_history_and_keep_exact_logprobs() -> None:
    engine = make_engine(4096)
    try:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        history = [BOS_ID, 5, 6, 7, SEP_ID]
        other = [BOS_ID, 9, 9, SEP_ID, 4]
        for turn in range(4):
            first, unrelated = engine.generate([history, other], params)
            assert first.output_logprobs == pytest.approx(
                recompute(engine.model, history, first.output_ids), abs=1e-5
            )
            assert unrelated.output_logprobs == pytest.approx(
                recompute(engine.model, other, unrelated.output_ids), abs=1e-5
            )
            if turn > 0:  # everything of the last turn but its last sampled token
                assert first.cached_tokens == len(history) - 3
                assert first.to_sglang()["meta_info"]["cached_tokens"] == first.cached_tokens
            history = history + first.output_ids + [SEP_ID, 3]  # an observation
            other = other + unrelated.output_ids[:2]  # shorter than what was cached
        stats = engine.stats
        assert stats.reused_tokens > stats.prefill_tokens  # most of the history came cached
    finally:
        engine.shutdown()


def test_new_weights_forget_every_cached_prefix() -> None:
    engine = make_engine(4096)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        prompt = [BOS_ID, 1, 2, SEP_ID]
        [done] = engine.generate([prompt], params)
        assert engine.prefix_cache is not None and len(engine.prefix_cache) == 1
        other = build_tiny_llama(seed=3).state_dict()
        engine.update_weights(other, "1").result(10)
        assert len(engine.prefix_cache) == 0
        extended = prompt + done.output_ids
        [after] = engine.generate([extended], params)
        assert after.cached_tokens == 0
        assert after.output_logprobs == pytest.approx(
            recompute(engine.model, extended, after.output_ids), abs=1e-5
        )
    finally:
        engine.shutdown()


def test_the_cache_stays_within_its_token_budget_and_drops_covered_entries() -> None:
    cache = PrefixCache(max_tokens=10)
    layer = [(torch.zeros(1, 6, 2), torch.zeros(1, 6, 2))]
    cache.store([1, 2, 3], [(k[:, :3], v[:, :3]) for k, v in layer])
    cache.store([1, 2, 3, 4, 5, 6], layer)  # covers the first: it goes
    assert len(cache) == 1 and cache.tokens == 6
    hit = cache.lookup([1, 2, 3, 4, 9, 9])
    assert hit is not None and hit.length == 4 and hit.layers[0][0].shape == (1, 4, 2)
    assert cache.lookup([1, 2]) is not None and cache.lookup([7, 2, 3]) is None
    cache.store([8, 8, 8, 8, 8, 8], layer)  # over budget: the least recently used goes
    assert cache.tokens <= 10 and len(cache) == 1 and cache.lookup([1, 2, 3, 4]) is None
    cache.store(list(range(11)), [(torch.zeros(1, 11, 2), torch.zeros(1, 11, 2))])
    assert cache.tokens <= 10  # a sequence over the whole budget is never kept
