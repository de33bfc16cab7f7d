"""Training-side log-probabilities of response tokens: one function for every role.

The stream processors compute ``logp_old`` (weights of the version that generated each
token) and the trainer computes ``logp_new`` (its current weights) with the *same*
function, so the two differ only by the weights: the staleness ratio
``s = exp(logp_new - logp_old)`` then carries no numerical noise from a different
batch layout or dtype path.

Batch layout (deterministic, documented because it fixes the numerics):

- Each row is ``prompt_ids + response_ids`` as int64, **right-padded** to the longest row
  of the batch with ``pad_id`` (the value never matters: padded positions are masked and
  their outputs dropped). Rows keep the order of the input.
- ``attention_mask`` is 1 on real tokens and 0 on padding.
- ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``: ``0..L-1`` on the real
  tokens of every row, exactly what an unpadded forward pass uses.
- The logits at position ``t`` score token ``t + 1``. Response token ``j`` of a row with
  a ``P``-token prompt is scored by position ``P + j - 1``. Only the positions from the
  batch's shortest prompt on go through the LM head (``logits_to_keep``), which does
  not change any value that is kept.
- ``log_softmax(logits.float() / temperature)``: logits are upcast to float32 before the
  softmax whatever the model dtype, and divided by the sampling temperature the way
  SGLang's sampler (and ``producers.engine.engine``) does, so that ``logp_infer`` and these
  values describe the same distribution.

Exactness: a batch of one row equals a direct ``model(input_ids=...)`` forward pass bit
for bit. In a padded batch a row can differ from its unpadded forward pass by float
rounding only (different matmul shapes): measured at most ~2e-7 in float32 on the tiny
model; tests allow ``PADDED_BATCH_ATOL`` (float32). The same batch through the same
function and weights is bit-identical run to run on one machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

PADDED_BATCH_ATOL = 1e-5
"""Documented tolerance (float32) between a row of a padded batch and its solo pass."""

Pair = tuple[Any, Any]
"""``(prompt_ids, response_ids)``: 1-D integer sequences (numpy arrays, lists, tensors)."""


def batch_layout(
    batch: Sequence[Pair], pad_id: int = 0, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """``(input_ids, attention_mask, position_ids, spans)`` for ``batch``.

    ``spans[i] = (P_i, R_i)``: prompt and response length of row ``i``.
    """
    import torch

    if not batch:
        raise ValueError("empty batch")
    rows: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    for prompt, response in batch:
        p = np.asarray(prompt, dtype=np.int64).reshape(-1)
        r = np.asarray(response, dtype=np.int64).reshape(-1)
        if len(p) == 0:
            raise ValueError(
                "a prompt needs at least one token (the first response token is "
                "scored by the last prompt position)"
            )
        rows.append(np.concatenate([p, r]))
        spans.append((len(p), len(r)))
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    input_ids = torch.from_numpy(ids).to(device)
    attention_mask = torch.from_numpy(mask).to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids, spans


def response_logprobs_tensor(
    model: Any,
    batch: Sequence[Pair],
    dtype: torch.dtype | None = None,
    *,
    temperature: float = 1.0,
    state: Mapping[str, torch.Tensor] | None = None,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, mask)``, both ``[B, R_max]``: log-prob of each response token, and 1.0 where
    a response token exists (0.0 on padding, where ``logp`` is 0).
    ``response_logprobs_entropy`` adds the entropy of each position's distribution.

    Carries gradients when called under grad mode (the trainer's ``logp_new``).

    ``dtype``: the dtype the forward pass runs in. Without ``state`` the model's own
    parameters must already have it (a mismatch raises rather than silently computing
    different numerics); with ``state`` (a state dict of one version, run through
    ``torch.func.functional_call`` without touching the module's own weights) tensors of
    another dtype are cast. ``None`` means the model's dtype.
    """
    logp, mask, _ = _response_logprobs(
        model, batch, dtype, temperature=temperature, state=state, pad_id=pad_id, entropy=False
    )
    return logp, mask


def response_logprobs_entropy(
    model: Any,
    batch: Sequence[Pair],
    dtype: torch.dtype | None = None,
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``response_logprobs_tensor``'s ``(logp, mask)`` and ``[B, R_max]`` entropies (nats,
    no gradient) of the tempered distribution each response token was drawn from: the
    trainer's ``policy/entropy``, from the same forward pass."""
    logp, mask, entropy = _response_logprobs(
        model, batch, dtype, temperature=temperature, state=None, pad_id=pad_id, entropy=True
    )
    assert entropy is not None
    return logp, mask, entropy


def _response_logprobs(
    model: Any,
    batch: Sequence[Pair],
    dtype: torch.dtype | None,
    *,
    temperature: float,
    state: Mapping[str, torch.Tensor] | None,
    pad_id: int,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    import torch

    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 (greedy decoding scores at 1), got {temperature}"
        )
    own = next(model.parameters())
    dtype = own.dtype if dtype is None else dtype
    params = None
    if state is None:
        if own.dtype != dtype:
            raise ValueError(f"model parameters are {own.dtype}, asked to run in {dtype}")
    else:
        params = params_for(model, state, dtype)

    input_ids, attention_mask, position_ids, spans = batch_layout(batch, pad_id, own.device)
    first = min(p for p, _ in spans) - 1  # first position whose logits are needed
    keep = input_ids.shape[1] - first
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
    )
    if params is None:
        logits = model(**kwargs).logits
    else:
        logits = torch.func.functional_call(model, params, (), kwargs, strict=False).logits
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, keep, V]

    width = max(r for _, r in spans)
    rows, cols, targets, out_rows, out_cols = [], [], [], [], []
    for i, (p, r) in enumerate(spans):
        rows.extend([i] * r)
        cols.extend(range(p - 1 - first, p - 1 - first + r))
        targets.extend(input_ids[i, p : p + r].tolist())
        out_rows.extend([i] * r)
        out_cols.extend(range(r))
    device = logp_all.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    cols_t = torch.tensor(cols, dtype=torch.long, device=device)
    picked = logp_all[rows_t, cols_t, torch.tensor(targets, dtype=torch.long, device=device)]
    logp = logp_all.new_zeros((len(spans), width))
    mask = logp_all.new_zeros((len(spans), width))
    index = (
        torch.tensor(out_rows, dtype=torch.long, device=device),
        torch.tensor(out_cols, dtype=torch.long, device=device),
    )
    logp = logp.index_put(index, picked)
    mask = mask.index_put(index, torch.ones_like(picked))
    if not entropy:
        return logp, mask, None
    with torch.no_grad():
        at = logp_all[rows_t, cols_t]  # [N, V]: the distributions the tokens came from
        values = -(at.exp() * at).sum(-1)
        entropies = logp_all.new_zeros((len(spans), width)).index_put(index, values)
    return logp, mask, entropies


def response_logprobs(
    model: Any,
    batch: Sequence[Pair],
    dtype: torch.dtype | None = None,
    *,
    temperature: float = 1.0,
    state: Mapping[str, torch.Tensor] | None = None,
    pad_id: int = 0,
) -> list[np.ndarray]:
    """Per row, the float32 log-probs of its response tokens (no gradient).

    The same numerics as ``response_logprobs_tensor``; see the module docstring for the
    batch layout. An empty response gives an empty array.
    """
    import torch

    with torch.inference_mode():
        logp, _ = response_logprobs_tensor(
            model, batch, dtype, temperature=temperature, state=state, pad_id=pad_id
        )
    values = logp.float().cpu().numpy()
    return [
        np.ascontiguousarray(values[i, : len(np.asarray(response).reshape(-1))], dtype=np.float32)
        for i, (_, response) in enumerate(batch)
    ]


def params_for(
    model: Any, state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` that replace the module's parameters and buffers
    (``torch.func.functional_call``), parameters cast to ``dtype``, all on the model's device.

    Every parameter must be present (a missing one would silently keep the module's own
    weights, which belong to no version). Tied parameters appear once in
    ``named_parameters``; an alias in ``state`` must hold the same values (a state whose
    tied tensors diverged describes no model, so it raises ``ValueError``).
    """
    import torch

    names = [name for name, _ in model.named_parameters()]
    missing = [name for name in names if name not in state]
    if missing:
        raise KeyError(f"state lacks {len(missing)} parameter(s) of the model, e.g. {missing[:3]}")
    canonical = {id(p): name for name, p in model.named_parameters()}
    for alias, param in model.named_parameters(remove_duplicate=False):
        name = canonical[id(param)]
        if alias != name and alias in state:
            a, b = state[alias], state[name]
            if a.data_ptr() != b.data_ptr() and not torch.equal(a, b):
                raise ValueError(f"tied parameters {name} and {alias} differ in the state")
    device = next(model.parameters()).device  # a state held elsewhere runs here all the same
    params = {name: state[name].to(device=device, dtype=dtype) for name in names}
    for name, buffer in model.named_buffers():
        if name in state:
            params[name] = state[name].to(device=buffer.device, dtype=buffer.dtype)
    return params
