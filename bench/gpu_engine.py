"""An engine serving the run's model over SGLang's API, checked by the producer's client:
``bench.gpu_check``'s sixth check (``--engine sglang`` on a GPU, ``cpu`` in the suite).

``rollstream serve --engine ENGINE`` is started as a user would start it, on a checkpoint
directory of the chosen shape (random weights, the tiny model's files). Then, through
``producers.engine.backends.HttpBackend`` (the producer's own path):

1. generate a batch with log-probs; the engine's log-probs against the old-logit pass
   (``core.logprobs``) over the same tokens on the same weights (SGLang's kernels differ
   from a plain forward pass: the difference is reported, a CPU engine must match);
2. publish version 1 as the producer does (``update_weights_from_disk`` with its files) and
   generate again: every answer says version 1, and its log-probs follow the new weights.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from core.logprobs import response_logprobs
from core.model_files import write_model_files
from core.models import build_tiny_llama, parse_model_spec
from core.process import free_port, tail
from producers.engine.backends import HttpBackend
from producers.engine.client import EngineClient, GenerateOutput
from producers.engine.weights import save_weights

#: engine log-probs against the old-logit pass: a CPU engine runs the same float32 math
CPU_ENGINE_TOLERANCE = 1e-4
#: ... and SGLang's bf16 kernels on a GPU (sampling kernels, fused norms) stay this close
SGLANG_TOLERANCE = 0.1


@dataclass
class EngineReport:
    engine: str
    model: str
    startup_s: float
    generated_tokens: int
    generate_tokens_per_s: float
    max_abs_diff_v0: float
    followed_version_1: bool
    max_abs_diff_v1: float
    passed: bool


def _serve(kind: str, model_dir: Path, weights_dir: Path, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rollstream"]
    argv += ["--set", f"producers.engine.weights_dir={weights_dir}"]
    argv += ["serve", "--engine", kind, "--model", str(model_dir), "--port", str(port)]
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}):\n{tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the engine was not healthy in {timeout_s:.0f}s:\n{tail(log)}")


def _max_diff(
    model: torch.nn.Module, prompts: list[list[int]], outs: list[GenerateOutput]
) -> float:
    batch = [(p, o.output_ids) for p, o in zip(prompts, outs, strict=True)]
    ours = response_logprobs(model, batch, torch.float32)
    return max(
        float((torch.as_tensor(o.logprobs) - torch.as_tensor(mine)).abs().max())
        for o, mine in zip(outs, ours, strict=True)
    )


async def _exercise(
    url: str, backend_dir: Path, model_dir: Path, prompts: list[list[int]], new: dict, tokens: int
) -> tuple[list[GenerateOutput], float, list[GenerateOutput]]:
    backend = HttpBackend(
        EngineClient(url, request_timeout=600), backend_dir, template_dir=model_dir
    )
    sampling = [{"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}] * len(prompts)
    try:
        rids = [f"v0-{i}" for i in range(len(prompts))]
        await backend.generate(prompts[:1], sampling[:1], ["warm-up"])
        start = time.perf_counter()
        v0 = await backend.generate(prompts, sampling, rids)
        seconds = time.perf_counter() - start
        await backend.load_version(1, new)
        v1 = await backend.generate(prompts, sampling, [f"v1-{i}" for i in range(len(prompts))])
    finally:
        await backend.aclose()
    return v0, seconds, v1


def check(
    engine: str = "sglang",
    spec: str = "tiny",
    device: str = "cpu",
    rows: int = 8,
    tokens: int = 32,
    timeout_s: float = 600.0,
) -> EngineReport:
    """Run the module doc's checks with ``rollstream serve --engine engine`` on ``spec``;
    the old-logit pass runs on ``device``."""
    tiny = parse_model_spec(spec).tiny_kwargs
    base, new = build_tiny_llama(seed=0, **tiny), build_tiny_llama(seed=7, **tiny)
    vocab = base.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, vocab, (8 + i % 5,), generator=generator).tolist() for i in range(rows)
    ]
    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as tmp:
        root = Path(tmp)
        model_dir, weights_dir = root / "model", root / "weights"
        write_model_files(spec, model_dir)
        save_weights(base.state_dict(), model_dir)
        port = free_port()
        proc = _serve(engine, model_dir, weights_dir, port, root / "engine.log")
        try:
            url = f"http://127.0.0.1:{port}"
            startup = _wait_healthy(url, proc, root / "engine.log", timeout_s)
            v0, seconds, v1 = asyncio.run(
                _exercise(url, weights_dir, model_dir, prompts, new.state_dict(), tokens)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    diff_v0 = _max_diff(base.to(device), prompts, v0)
    diff_v1 = _max_diff(new.to(device), prompts, v1)
    followed = all(o.weight_version == "1" for o in v1) and all(o.weight_version == "0" for o in v0)
    tolerance = CPU_ENGINE_TOLERANCE if engine == "cpu" else SGLANG_TOLERANCE
    generated = sum(len(o.output_ids) for o in v0)
    return EngineReport(
        engine=engine,
        model=spec,
        startup_s=startup,
        generated_tokens=generated,
        generate_tokens_per_s=generated / seconds,
        max_abs_diff_v0=diff_v0,
        followed_version_1=followed,
        max_abs_diff_v1=diff_v1,
        passed=followed and max(diff_v0, diff_v1) <= tolerance,
    )
