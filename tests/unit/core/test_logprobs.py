"""``core.logprobs`` against direct transformers forward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.logprobs import (
    PADDED_BATCH_ATOL,
    batch_layout,
    response_logprobs,
    response_logprobs_entropy,
    response_logprobs_tensor,
)
from core.models import build_tiny_llama

torch.set_num_threads(1)


def direct(model, prompt, response, temperature: float = 1.0, state=None) -> np.ndarray:
    """Log-probs from one unpadded forward pass, written independently of the module."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.inference_mode():
        if state is None:
            logits = model(input_ids=ids).logits
        else:
            logits = torch.func.functional_call(model, dict(state), (), {"input_ids": ids}).logits
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)[0]
    p = len(prompt)
    return np.array([logp[p + j - 1, tok].item() for j, tok in enumerate(response)], np.float32)


def random_pairs(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (rng.integers(0, 16, rng.integers(1, 9)), rng.integers(0, 16, rng.integers(1, 12)))
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def model():
    return build_tiny_llama(seed=3)


def test_batch_of_one_is_bit_exact(model) -> None:
    rng = np.random.default_rng(0)
    for prompt, response in random_pairs(rng, 8):
        (got,) = response_logprobs(model, [(prompt, response)])
        want = direct(model, prompt, response)
        assert got.dtype == np.float32
        assert got.tobytes() == want.tobytes()


def test_padded_batch_within_documented_tolerance(model) -> None:
    rng = np.random.default_rng(1)
    pairs = random_pairs(rng, 6)
    got = response_logprobs(model, pairs)
    for (prompt, response), values in zip(pairs, got, strict=True):
        assert len(values) == len(response)
        np.testing.assert_allclose(values, direct(model, prompt, response), atol=PADDED_BATCH_ATOL)


def test_same_batch_is_deterministic(model) -> None:
    pairs = random_pairs(np.random.default_rng(2), 5)
    a = response_logprobs(model, pairs)
    b = response_logprobs(model, pairs)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def test_temperature_divides_logits(model) -> None:
    prompt, response = np.array([1, 5, 6]), np.array([7, 8, 2])
    (got,) = response_logprobs(model, [(prompt, response)], temperature=0.7)
    assert got.tobytes() == direct(model, prompt, response, temperature=0.7).tobytes()


def test_entropy_is_that_of_each_tokens_distribution(model) -> None:
    pairs = random_pairs(np.random.default_rng(4), 4)
    batch = [(list(p), list(r)) for p, r in pairs]
    logp, mask = response_logprobs_tensor(model, batch, temperature=0.8)
    same_logp, same_mask, entropy = response_logprobs_entropy(model, batch, temperature=0.8)
    assert torch.equal(logp, same_logp) and torch.equal(mask, same_mask)
    assert not entropy.requires_grad
    for row, (prompt, response) in enumerate(pairs):
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0].float() / 0.8
        p = len(prompt)
        want = torch.distributions.Categorical(logits=logits[p - 1 : p - 1 + len(response)])
        got = entropy[row, : len(response)]
        torch.testing.assert_close(got, want.entropy(), atol=PADDED_BATCH_ATOL, rtol=0)
        assert torch.all(entropy[row, len(response) :] == 0)


def test_state_replaces_weights_without_touching_the_module(model) -> None:
    other = build_tiny_llama(seed=11)
    state = other.state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt, response = np.array([1, 9, 4]), np.array([3, 3, 10, 2])
    (got,) = response_logprobs(model, [(prompt, response)], state=state)
    assert got.tobytes() == direct(other, prompt, response).tobytes()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_state_missing_a_parameter_is_refused(model) -> None:
    state = dict(build_tiny_llama(seed=1).state_dict())
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        response_logprobs(model, [([1], [2])], state=state)


def test_state_with_diverged_tied_weights_is_refused(model) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}  # clones break the tie
    response_logprobs(model, [([1], [2])], state=state)  # equal values: fine
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="tied"):
        response_logprobs(model, [([1], [2])], state=state)


def test_dtype_mismatch_without_state_raises(model) -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        response_logprobs(model, [([1], [2])], torch.bfloat16)


def test_bfloat16_state_runs_in_bfloat16(model) -> None:
    bf16 = build_tiny_llama(seed=3).to(torch.bfloat16)
    prompt, response = np.array([1, 4, 4]), np.array([5, 6])
    (got,) = response_logprobs(
        model, [(prompt, response)], torch.bfloat16, state=model.state_dict()
    )
    assert got.tobytes() == direct(bf16, prompt, response).tobytes()


def test_tensor_version_carries_gradient_and_mask(model) -> None:
    pairs = [(np.array([1, 2]), np.array([3, 4, 5])), (np.array([1]), np.array([6]))]
    logp, mask = response_logprobs_tensor(model, pairs)
    assert logp.shape == mask.shape == (2, 3)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert logp[1, 1:].abs().sum().item() == 0
    logp.sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_layout_is_right_padded_with_positions_from_zero() -> None:
    ids, mask, pos, spans = batch_layout([([1, 2], [3]), ([4], [5, 6, 7])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 2], [0, 1, 2, 3]]
    assert spans == [(2, 1), (1, 3)]


def test_empty_prompt_is_refused(model) -> None:
    with pytest.raises(ValueError, match="prompt"):
        response_logprobs(model, [([], [1, 2])])
