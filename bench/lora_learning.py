"""LoRA against full fine-tuning on the tiny task: how much learning an adapter gives up.

Run from the repository root:
``python -m bench.lora_learning [--seeds 3] [--steps 300] [--ranks 8] [--lr-scales 1,10]``.

Every arm trains the same ``bench.learning`` cell (route ``decoupled-mis``, staleness
``--staleness``, the default ``Settings`` otherwise) for seeds ``0..N-1``: full fine-tuning
at the grid's learning rate, then a LoRA adapter (``core.models.add_lora``: B = 0 at
start, only the adapter trains; the project's default alpha and target modules) of each
rank at each multiple of that rate, since an adapter usually needs a higher one. Cells
run one after another in this process, so the arms are measured side by side.

Prints a markdown table, per arm mean ± sd over seeds: steps to the grid's reward target
(10-step mean; over the seeds that reach it), final reward (``CellResult.final``), CPU
seconds per step, trainable parameters, and the bytes a version costs (the adapter's
``adapter_model.safetensors`` as ``core.models.save_adapter`` writes it, against the full
model's tensors in bf16), with the date and the machine (cores, CPU, ``avx512_bf16``).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from bench.figures import spread
from bench.learning import ROUTES, CellResult, Settings, run_cell

if TYPE_CHECKING:
    from core.config import LoraConfig

ROUTE = "decoupled-mis"


@dataclass(frozen=True)
class Arm:
    """One way of training: every weight, or an adapter of ``lora.rank``, at ``lr``."""

    name: str
    lr: float
    lora: LoraConfig | None


@dataclass
class ArmResult:
    arm: Arm
    cells: list[CellResult]
    trainable: int  # parameters the optimiser updates
    version_bytes: int  # what one published version holds, as a file


def arms(ranks: list[int], lr_scales: list[float], lr: float) -> list[Arm]:
    """Full fine-tuning at ``lr``, then every rank at every multiple of ``lr``."""
    from core.config import LoraConfig

    out = [Arm("full", lr, None)]
    for rank in ranks:
        for scale in lr_scales:
            out.append(Arm(f"LoRA r{rank}, lr x{scale:g}", lr * scale, LoraConfig(rank=rank)))
    return out


def version_cost(lora: LoraConfig | None, spec: str) -> tuple[int, int]:
    """Trainable parameters and bytes per version: the adapter's safetensors file (bf16,
    as ``save_adapter`` writes a bf16 state), or the full model's tensors in bf16 (tied
    tensors once), as a safetensors file."""
    import safetensors.torch
    import torch

    from core.models import load_model, save_adapter

    model = load_model(spec, "float32", lora=lora)
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    seen: set[int] = set()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.to(torch.bfloat16).contiguous()
    with tempfile.TemporaryDirectory() as tmp:
        if lora is not None:
            path = save_adapter(state, lora, Path(tmp), spec) / "adapter_model.safetensors"
        else:
            path = Path(tmp) / "model.safetensors"
            safetensors.torch.save_file(state, path)
        size = path.stat().st_size
    return sum(trainable.values()), size


def machine() -> str:
    """Cores this process may use, the CPU model, and whether it has native bf16 (AVX-512)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    bf16 = "with" if "avx512_bf16" in flags.split() else "without"
    return f"{len(os.sched_getaffinity(0))} cores ({model}), {bf16} avx512_bf16"


def table(results: list[ArmResult], settings: Settings) -> str:
    """One row per arm (see the module doc)."""
    lines = [
        f"| arm | lr | steps to {settings.target:g} (mean ± sd, reached) | final reward | "
        "CPU s / step | trainable params | bytes / version |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        cells = result.cells
        steps = [s for s in (c.step_to(settings.target) for c in cells) if s is not None]
        reached = (
            f"{spread(steps, 0)} ({len(steps)}/{len(cells)})"
            if steps
            else f"not reached (0/{len(cells)})"
        )
        per_step = [c.cpu_s[-1] / len(c.cpu_s) for c in cells]
        lines.append(
            f"| {result.arm.name} | {result.arm.lr:g} | {reached} | "
            f"{spread([c.final() for c in cells])} | {spread(per_step, 3)} | "
            f"{result.trainable:,} | {result.version_bytes:,} |"
        )
    return "\n".join(lines)


def _list(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--ranks", default="8", help="comma-separated LoRA ranks")
    parser.add_argument("--lr-scales", default="1,10", help="LoRA lr as multiples of --lr")
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--staleness", type=int, default=1)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    route = next(r for r in ROUTES if r.name == ROUTE)
    base = Settings(steps=args.steps, lr=args.lr)
    plan = arms(_list(args.ranks, int), _list(args.lr_scales, float), args.lr)
    print(
        f"{len(plan)} arms x {args.seeds} seeds x {args.steps} steps, {ROUTE}, "
        f"k = {args.staleness}",
        flush=True,
    )
    started = time.perf_counter()
    results = []
    for arm in plan:
        settings = replace(base, lr=arm.lr, lora=arm.lora)
        cells = []
        for seed in range(args.seeds):
            cell = run_cell(route, args.staleness, seed, settings)
            cells.append(cell)
            print(
                f"{arm.name:20s} seed {seed}: final {cell.final():.2f}, to "
                f"{base.target:g} at {cell.step_to(base.target)}, {cell.cpu_s[-1]:.0f} CPU s",
                flush=True,
            )
        trainable, size = version_cost(arm.lora, "tiny:seed=0")
        results.append(ArmResult(arm, cells, trainable, size))
    elapsed = time.perf_counter() - started
    from core.config import LoraConfig

    default = LoraConfig()
    print(
        f"\n{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; {machine()}; "
        f"{elapsed / 60:.1f} min wall-clock. `python -m bench.lora_learning --seeds "
        f"{args.seeds} --steps {args.steps} --ranks {args.ranks} --lr-scales "
        f"{args.lr_scales}`: route {ROUTE}, staleness {args.staleness}, seeds "
        f"0..{args.seeds - 1}; LoRA alpha {default.alpha:g} on "
        f"{', '.join(default.target_modules)} (the project's defaults).\n"
    )
    print(table(results, base))


if __name__ == "__main__":
    main()
