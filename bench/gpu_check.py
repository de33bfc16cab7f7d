"""Old logits on a GPU: ``python -m bench.gpu_check [--device auto] [--model smollm2-shape]``.

How a user validates the exact old-logit pass (``core.logprobs``, the function the stream
and the trainer share) on their accelerator before a run. On a randomly initialised
model of the chosen shape (nothing is downloaded), in bf16 and float32, it checks and
measures:

1. **Exactness.** Every row of a padded batch against an independent recompute: a plain
   ``model(input_ids=row)`` forward pass of that row alone, ``log_softmax`` in float32,
   the response tokens gathered. Reported as the largest absolute difference per dtype.
   The two differ by float rounding only (other matmul shapes), which grows with the
   model: float32 must stay within ``FLOAT32_ROUNDING`` (``core.logprobs`` documents
   ``PADDED_BATCH_ATOL`` for the tiny model). The stream and the trainer do not differ
   even by that: they lay out the same batch the same way.
2. **A version's weights.** The same batch through a state dict of the weights
   (``torch.func.functional_call``, as the stream runs a retained version) equals the
   module's own forward pass bit for bit.
3. **Device agreement.** float32 on the device against float32 on the CPU.
4. **Speed.** Response tokens/s of the old-logit pass against a bare forward pass of the
   same padded batch (which computes logits for every position and picks nothing).

5. **The roles.** The stream's old-logit service and the trainer (DeepSpeed, NCCL on
   CUDA) on the device through their own classes, one training step between two versions
   and the snapshot store's host tier: ``bench.gpu_roles``.

6. **The engine.** ``rollstream serve --engine sglang`` (SGLang where it is installed, else
   the CPU engine: ``--engine``) on the same shape, driven by the producer's own backend:
   its log-probs against the old-logit pass, and a new version followed: ``bench.gpu_engine``.

It is not part of CI (CI has no GPU); ``--device cpu`` runs the same code on the CPU (a
test does, on the tiny model).

7. **Ranks.** Where two GPUs are, the trainer as two NCCL ranks trains the same steps and
   both end bit-identical: ``bench.gpu_ranks``, under torch's launcher.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench import gpu_engine, gpu_roles
from core.devices import resolve_device
from core.logprobs import batch_layout, response_logprobs
from core.models import build_tiny_llama, cast_parameters
from infra.sglang import NotInstalled, SGLangServer, require_module

#: float32 rounding allowed between a padded row and its solo pass; measured on an H200
#: (2026-11-26): 3.8e-6 at 148M parameters, 3.5e-5 at 1.1B
FLOAT32_ROUNDING = 1e-4

#: response tokens of check 6 on the CPU engine, which generates on the host's cores: 47
#: tokens/s at the 148M shape on an H200 machine's host (2026-11-27), where --response's
#: 384 tokens x 8 rows x 3 calls outran the check
CPU_ENGINE_TOKENS = 16

#: model shapes (``core.models.build_tiny_llama`` arguments), random weights
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "smollm2-shape": {  # SmolLM2-135M's dimensions (grouped-query heads left out)
        "vocab_size": 49152,
        "hidden_size": 576,
        "num_layers": 30,
        "num_heads": 9,
        "intermediate_size": 1536,
        "max_positions": 2048,
    },
    "1b-shape": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "num_layers": 16,
        "num_heads": 16,
        "intermediate_size": 8192,
        "max_positions": 2048,
    },
}


@dataclass
class Report:
    device: str
    device_name: str
    model: str
    parameters: int
    rows: int
    prompt_tokens: int
    response_tokens: int
    max_abs_diff_vs_solo: dict[str, float]
    state_dict_path_bitwise_equal: dict[str, bool]
    max_abs_diff_device_vs_cpu_fp32: float | None
    old_logit_tokens_per_s: dict[str, float]
    bare_forward_tokens_per_s: dict[str, float]
    passed: bool


def _batch(vocab: int, rows: int, prompt: int, response: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(rows):
        p, r = prompt - (i % 4) * 3, response - (i % 5) * 7  # ragged: padding is exercised
        ids = torch.randint(3, vocab, (p + r,), generator=generator)
        batch.append((ids[:p].numpy(), ids[p:].numpy()))
    return batch


def _solo(model: Any, pair: tuple) -> torch.Tensor:
    """The independent recompute: one row, no padding, no positions given."""
    prompt, response = (torch.as_tensor(x, dtype=torch.long) for x in pair)
    ids = torch.cat([prompt, response])[None].to(next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    targets = ids[0, p:]
    return logp[p - 1 : p - 1 + len(response)].gather(1, targets[:, None])[:, 0].cpu()


def _timed(fn: Any, device: str, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(
    device: str, model_name: str, rows: int, prompt: int, response: int, repeats: int
) -> Report:
    """Run the four checks of the module doc on ``device``."""
    shape = SHAPES[model_name]
    base = build_tiny_llama(seed=0, **shape)
    vocab = base.config.vocab_size
    batch = _batch(vocab, rows, prompt, response, seed=1)
    tokens = sum(len(r) for _, r in batch)
    diffs: dict[str, float] = {}
    bitwise: dict[str, bool] = {}
    speed: dict[str, float] = {}
    bare: dict[str, float] = {}
    fp32_on_device: list = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        model = cast_parameters(build_tiny_llama(seed=0, **shape), dtype).to(device).eval()
        ours = response_logprobs(model, batch, dtype)
        if dtype_name == "float32":
            fp32_on_device = ours
        solo = [_solo(model, pair) for pair in batch]
        diffs[dtype_name] = max(
            float((torch.as_tensor(a) - b).abs().max()) for a, b in zip(ours, solo, strict=True)
        )
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        through_state = response_logprobs(model, batch, dtype, state=state)
        bitwise[dtype_name] = all(
            bool((torch.as_tensor(a) == torch.as_tensor(b)).all())
            for a, b in zip(ours, through_state, strict=True)
        )
        input_ids, attention_mask, position_ids, _ = batch_layout(batch, 0, device)

        def forward(
            m: Any = model, i: Any = input_ids, a: Any = attention_mask, p: Any = position_ids
        ) -> None:
            with torch.inference_mode():
                m(input_ids=i, attention_mask=a, position_ids=p, use_cache=False)

        speed[dtype_name] = tokens / _timed(
            lambda m=model, d=dtype: response_logprobs(m, batch, d), device, repeats
        )
        bare[dtype_name] = tokens / _timed(forward, device, repeats)
        del model
    cpu_diff = None
    if device != "cpu":
        cpu_model = build_tiny_llama(seed=0, **shape)
        on_cpu = response_logprobs(cpu_model, batch, torch.float32)
        cpu_diff = max(float(abs(a - b).max()) for a, b in zip(fp32_on_device, on_cpu, strict=True))
    passed = diffs["float32"] <= FLOAT32_ROUNDING and all(bitwise.values())
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return Report(
        device=device,
        device_name=name,
        model=model_name,
        parameters=sum(p.numel() for p in base.parameters()),
        rows=rows,
        prompt_tokens=prompt,
        response_tokens=response,
        max_abs_diff_vs_solo=diffs,
        state_dict_path_bitwise_equal=bitwise,
        max_abs_diff_device_vs_cpu_fp32=cpu_diff,
        old_logit_tokens_per_s=speed,
        bare_forward_tokens_per_s=bare,
        passed=passed,
    )


def run_ranks(ranks: int, device: str, spec: str, dtype: str) -> dict[str, Any]:
    """``bench.gpu_ranks`` as ``ranks`` processes under torch's launcher: rank 0's report."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    argv += ["-m", "bench.gpu_ranks", "--device", device.split(":")[0]]
    argv += ["--model", spec, "--dtype", dtype]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith('{"ranks"'):
            report: dict[str, Any] = json.loads(line)["ranks"]
            return report
    raise RuntimeError(f"bench.gpu_ranks exited {done.returncode}:\n{done.stderr[-3000:]}")


def _engine_kind(choice: str, device: str) -> str:
    """``auto``: SGLang where a GPU is and SGLang is installed, else the CPU engine."""
    if choice != "auto":
        return choice
    try:
        require_module(SGLangServer.module, SGLangServer.install)
    except NotInstalled as missing:
        print(f"{missing}; check 6 runs the CPU engine")
        return "cpu"
    return "sglang" if device.startswith("cuda") else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
    parser.add_argument("--model", default="smollm2-shape", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128, help="Longest prompt, tokens.")
    parser.add_argument("--response", type=int, default=384, help="Longest response, tokens.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "sglang", "cpu", "none"],
        help="The engine of check 6; auto: SGLang on a GPU where it is installed, else cpu.",
    )
    args = parser.parse_args()
    device = str(resolve_device(args.device))
    report = check(device, args.model, args.rows, args.prompt, args.response, args.repeats)
    print(json.dumps(asdict(report), indent=2))
    ratio = {k: report.old_logit_tokens_per_s[k] / report.bare_forward_tokens_per_s[k]
             for k in report.old_logit_tokens_per_s}  # fmt: skip
    print(f"old-logit pass / bare forward, tokens/s: {ratio}")
    passed = report.passed
    spec = "tiny:" + ",".join(f"{k}={v}" for k, v in SHAPES[args.model].items())
    for dtype in ("float32", "bfloat16"):
        roles = gpu_roles.check(device, spec.rstrip(":"), dtype, response_len=args.response)
        print(json.dumps({"roles": asdict(roles)}, indent=2))
        passed = passed and roles.passed
    if torch.distributed.is_initialized():  # the trainer's world of one
        torch.distributed.destroy_process_group()
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        for dtype in ("float32", "bfloat16"):
            ranked = run_ranks(2, device, spec.rstrip(":"), dtype)
            print(json.dumps({"ranks": ranked}, indent=2))
            passed = passed and ranked["passed"]
    engine = _engine_kind(args.engine, device)
    if engine != "none":
        tokens = args.response if engine == "sglang" else min(args.response, CPU_ENGINE_TOKENS)
        served = gpu_engine.check(engine, spec.rstrip(":"), device, tokens=tokens)
        print(json.dumps({"engine": asdict(served)}, indent=2))
        passed = passed and served.passed
    print("PASSED" if passed else "FAILED")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
