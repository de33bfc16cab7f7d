"""The CPU engine: sampling numerics, batching, abort, weight updates (no HTTP here)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from core.models import BOS_ID, EOS_ID, SEP_ID, build_tiny_llama
from producers.engine.engine import Engine
from producers.engine.requests import RequestError, SamplingParams
from producers.engine.weights import load_state_dict_checked, read_weights, save_weights

torch.set_num_threads(1)

PROMPTS = [[BOS_ID, 5, 6, 7, SEP_ID], [BOS_ID, 8, SEP_ID], [BOS_ID, 9, 9, 9, 9, 9, 9, SEP_ID]]


def recompute(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list:
    """log softmax(logits / T) of each response token, from one plain forward pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logp[start + i, token]) for i, token in enumerate(response)]


@pytest.fixture()
def engine():
    engine = Engine(build_tiny_llama(seed=0), model_path="tiny", seed=1).start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_pass(engine, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=20, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert len(result.output_ids) == 20
        expected = recompute(engine.model, prompt, result.output_ids, temperature)
        assert result.output_logprobs == pytest.approx(expected, abs=1e-5)


def test_greedy_is_argmax_and_reports_raw_logprobs(engine):
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = list(prompt)
        with torch.inference_mode():
            for token in result.output_ids:
                logits = engine.model(torch.tensor([ids])).logits[0, -1]
                assert token == int(logits.argmax())
                ids.append(token)
        expected = recompute(engine.model, prompt, result.output_ids, 1.0)
        assert result.output_logprobs == pytest.approx(expected, abs=1e-5)


def test_top_k_and_top_p_restrict_the_draw_not_the_logprob(engine):
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.9, max_new_tokens=12, ignore_eos=True)
    for prompt, result in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        ids = list(prompt)
        with torch.inference_mode():
            for token in result.output_ids:
                top2 = engine.model(torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
                assert token in top2
                ids.append(token)
        expected = recompute(engine.model, prompt, result.output_ids)
        assert result.output_logprobs == pytest.approx(expected, abs=1e-5)


def test_stop_tokens_length_and_finish_reasons(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    first = engine.generate([PROMPTS[0]], greedy)[0].output_ids[0]
    stopped = engine.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(first,)),
    )[0]
    # The stop token is part of output_ids (as in SGLang) and ends generation.
    assert stopped.output_ids == [first]
    assert stopped.finish_reason == {"type": "stop", "matched": first}
    # EOS stops unless ignore_eos; here the model's greedy first token plays EOS.
    eos_engine = Engine(engine.model, model_path="tiny", eos_token_ids=[first])
    assert eos_engine.eos_token_ids == (first,)
    by_eos = eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0))[0]
    assert by_eos.finish_reason == {"type": "stop", "matched": first}
    assert len(eos_engine.generate([PROMPTS[0]], greedy)[0].output_ids) == 40
    assert engine.eos_token_ids == (EOS_ID,)
    capped = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert capped.finish_reason == {"type": "length", "length": 3}
    assert len(capped.output_ids) == 3


def test_busy_seconds_count_compute_not_idle_time(engine):
    assert engine.stats.busy_s == 0.0
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    began = time.perf_counter()
    engine.submit(PROMPTS[0], params).result(timeout=30)
    generated = time.perf_counter() - began
    assert 0.0 < engine.stats.busy_s <= generated
    busy = engine.stats.busy_s
    time.sleep(0.2)  # idle: the scheduler waits, nothing is computed
    assert engine.stats.busy_s == busy
    engine.update_weights(engine.model.state_dict(), "1").result(timeout=30)
    assert engine.stats.busy_s > busy  # a weight update occupies the engine too


def test_context_limit_ends_with_length(engine):
    prompt = [BOS_ID] + [5] * 60  # the tiny model has 64 positions
    result = engine.generate([prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert result.finish_reason["type"] == "length"
    assert len(prompt) + len(result.output_ids) == 64


def test_concurrent_submissions_are_batched(engine):
    engine.batch_wait_s = 0.05
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    futures = engine.submit_many([(p, params, None, True) for p in PROMPTS * 3])
    results = [f.result(timeout=30) for f in futures]
    assert all(len(r.output_ids) == 4 for r in results)
    assert engine.stats.max_batch_seen == 9
    assert engine.stats.batches == 1


def test_abort_keeps_partial_output_and_frees_the_engine(engine):
    engine.step_delay_s = 0.01
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    future = engine.submit([BOS_ID, 5, SEP_ID], params, rid="long", return_logprob=True)
    while engine.stats.tokens_generated < 3:
        time.sleep(0.005)
    assert engine.abort("long") == 1
    result = future.result(timeout=30)
    assert result.finish_reason["type"] == "abort"
    assert 3 <= len(result.output_ids) < 60
    assert len(result.output_logprobs) == len(result.output_ids)
    expected = recompute(engine.model, [BOS_ID, 5, SEP_ID], result.output_ids)
    assert result.output_logprobs == pytest.approx(expected, abs=1e-5)
    assert engine.abort("long") == 0  # no longer in flight


def test_abort_all_reaches_running_and_queued_requests(engine):
    engine.step_delay_s = 0.01
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    running = engine.submit(PROMPTS[0], params)
    while engine.stats.tokens_generated < 1:
        time.sleep(0.005)
    queued = engine.submit(PROMPTS[1], params)  # queued, or just joined the batch
    assert engine.abort(abort_all=True) == 2
    for future in (running, queued):
        result = future.result(timeout=30)
        assert result.finish_reason["type"] == "abort"
        assert len(result.output_ids) < 60
    # Queued requests that never started finish at once, without tokens.
    engine.shutdown()
    idle = Engine(engine.model, model_path="tiny")  # no scheduler thread: stays queued
    waiting = idle.submit(PROMPTS[1], params)
    idle.abort(abort_all=True)
    assert waiting.result(timeout=5).output_ids == []


def test_weight_update_applies_between_batches(engine, tmp_path):
    other = build_tiny_llama(seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = engine.generate([PROMPTS[0]], params)[0]
    assert engine.update_weights(other.state_dict(), "3").result(timeout=30) == 0
    after = engine.generate([PROMPTS[0]], params)[0]
    assert after.weight_version == "3"
    assert after.output_logprobs == pytest.approx(
        recompute(other, PROMPTS[0], after.output_ids), abs=1e-5
    )
    assert before.output_logprobs != after.output_logprobs
    # From disk, as /update_weights_from_disk does: tied embeddings are stored once.
    save_weights(build_tiny_llama(seed=0).state_dict(), tmp_path / "v4")
    assert "lm_head.weight" not in read_weights(tmp_path / "v4")
    engine.update_weights_from_disk(tmp_path / "v4", "4").result(timeout=30)
    again = engine.generate([PROMPTS[0]], params)[0]
    assert (again.output_ids, again.weight_version) == (before.output_ids, "4")


def test_bad_weights_are_refused_and_the_old_ones_kept(engine, tmp_path):
    state = dict(build_tiny_llama(seed=3).state_dict())
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"lack tensors.*model\.norm\.weight"):
        engine.update_weights(state, "9").result(timeout=30)
    with pytest.raises(ValueError, match="tensors the model lacks"):
        load_state_dict_checked(engine.model, {"bogus": torch.zeros(1)})
    with pytest.raises(FileNotFoundError):
        engine.update_weights_from_disk(tmp_path, "9").result(timeout=30)
    assert engine.weight_version == "0"


def test_a_checkpoint_refused_for_one_tensor_changes_no_other(engine, tmp_path):
    """torch's own load copies every fitting tensor before it reports a misshapen one: the
    engine would serve a half-applied version under the old version's name."""
    held = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    state = dict(build_tiny_llama(seed=3).state_dict())
    state["model.norm.weight"] = torch.zeros(3)  # sorts last: every other tensor fits
    save_weights(state, tmp_path / "v9")
    with pytest.raises(ValueError, match=r"another shape.*model\.norm\.weight: \(3,\)"):
        engine.update_weights_from_disk(tmp_path / "v9", "9").result(timeout=30)
    assert engine.weight_version == "0"
    after = engine.model.state_dict()
    assert [n for n in held if not torch.equal(after[n], held[n])] == []


def test_sampling_params_follow_sglang_and_refuse_what_they_cannot_honour():
    params = SamplingParams.from_dict(
        {
            "temperature": 0.5,
            "max_new_tokens": 7,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
        }
    )
    assert (params.temperature, params.max_new_tokens, params.stop_token_ids) == (0.5, 7, (2,))
    assert SamplingParams.from_dict({}) == SamplingParams()  # SGLang's defaults
    assert SamplingParams.from_dict({"n": 1, "frequency_penalty": 0.0}) == SamplingParams()
    for bad, message in [
        ({"n": 4}, "n=4"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"regex": "a+"}, "regex"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * 65]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"bogus": 1}, "bogus"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ]:
        with pytest.raises(RequestError, match=message):
            SamplingParams.from_dict(bad)


def test_stop_strings_end_generation_where_the_output_text_has_one():
    from core.models import TinyTokenizer

    engine = Engine(
        build_tiny_llama(seed=0), model_path="tiny", seed=3, tokenizer=TinyTokenizer()
    ).start()
    try:
        engine.generator.manual_seed(3)
        free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=30, ignore_eos=True))
        # a stop string the free run produced: the first two tokens' text
        text = engine.tokenizer.decode(free[0].output_ids[1:3])
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(text,))
        engine.generator.manual_seed(3)  # the same draws, as long as row 0 runs
        stopped = engine.generate(PROMPTS, params)[0]
        assert stopped.finish_reason == {"type": "stop", "matched": text}
        assert text in engine.tokenizer.decode(stopped.output_ids)
        assert text not in engine.tokenizer.decode(stopped.output_ids[:-1])
        assert SamplingParams.from_dict({"stop": "ab"}).stop == ("ab",)
    finally:
        engine.shutdown()
    bare = Engine(build_tiny_llama(seed=0), model_path="tiny")
    with pytest.raises(RequestError, match="tokenizer"):
        bare.generate([PROMPTS[0]], SamplingParams(stop=("1",)))


def test_invalid_requests_raise_before_anything_is_queued(engine):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit_many([(PROMPTS[0], params, "a", False), ([99], params, "b", False)])
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], params)
    with pytest.raises(RequestError, match="unique"):
        engine.submit_many([(PROMPTS[0], params, "x", False), (PROMPTS[1], params, "x", False)])
    assert engine.stats.requests == 0


def test_scheduler_survives_concurrent_clients(engine):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    results: list = []

    def client(i: int) -> None:
        results.append(engine.submit(PROMPTS[i % 3], params).result(timeout=60))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 16
    assert all(len(r.output_ids) == 5 for r in results)


def test_requests_join_a_running_batch(engine):
    engine.step_delay_s = 0.01
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    first = engine.submit(PROMPTS[2], params, return_logprob=True)
    while engine.stats.tokens_generated < 3:
        time.sleep(0.005)
    # Shorter and longer prompts arrive while the first decodes: they join its batch.
    later = engine.submit_many(
        [(PROMPTS[1], params, None, True), ([BOS_ID, *[6] * 20, SEP_ID], params, None, True)]
    )
    results = [first.result(timeout=60)] + [f.result(timeout=60) for f in later]
    assert engine.stats.batches == 1
    assert engine.stats.max_batch_seen == 3
    for prompt, result in zip(
        [PROMPTS[2], PROMPTS[1], [BOS_ID, *[6] * 20, SEP_ID]], results, strict=True
    ):
        assert len(result.output_ids) == 30
        expected = recompute(engine.model, prompt, result.output_ids)
        assert result.output_logprobs == pytest.approx(expected, abs=1e-5)


def test_weight_updates_are_never_joined_across(engine):
    engine.step_delay_s = 0.01
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    before = engine.submit(PROMPTS[0], params, return_logprob=True)
    while engine.stats.tokens_generated < 2:
        time.sleep(0.005)
    other = build_tiny_llama(seed=9)
    update = engine.update_weights(other.state_dict(), "1")
    after = engine.submit(PROMPTS[0], params, return_logprob=True)  # queued behind the update
    old, new = before.result(timeout=60), after.result(timeout=60)
    update.result(timeout=60)
    assert (old.weight_version, new.weight_version) == ("0", "1")
    assert engine.stats.batches == 2
    assert new.output_logprobs == pytest.approx(
        recompute(other, PROMPTS[0], new.output_ids), abs=1e-5
    )
