"""The DeepSpeed engine around a transformers causal LM.

``TrainEngine`` owns the model, a torch ``AdamW`` optimiser wrapped by DeepSpeed (ZeRO
stage 0-3, bf16 with fp32 master weights, gradient accumulation and clipping done by
DeepSpeed), its checkpoints, and the frozen copies some losses need (the EWMA proximal
model, a KL reference). Nothing here knows about Kafka.

The accelerator comes from the config (``auto``: CUDA when torch sees a GPU, else CPU)
and is handed to DeepSpeed through ``DS_ACCELERATOR`` *before* DeepSpeed is imported, so
the same code runs unchanged on this CPU machine (gloo) and on GPUs (nccl). A process
started without a launcher gets single-process defaults for ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``; under ``deepspeed``/``torchrun`` the launcher's win.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from consumers.build_lock import extensions_dir, extensions_root, preload_ops
from consumers.config import DECAYING_SCHEDULES, EngineConfig
from core.config import merge_tables
from core.devices import resolve_device
from core.models import cast_parameters
from core.process import free_port

log = logging.getLogger(__name__)


def resolve_accelerator(config: EngineConfig) -> str:
    """``cpu`` or ``cuda``; also exported as ``DS_ACCELERATOR`` for DeepSpeed."""
    name = config.accelerator
    if name == "auto":
        name = os.environ.get("DS_ACCELERATOR") or resolve_device("auto").type
    os.environ["DS_ACCELERATOR"] = name
    return name


def import_deepspeed() -> ModuleType:
    """Import DeepSpeed without MLflow: its autotuner, which rollstream does not use,
    imports MLflow whenever it is installed (1.2 of its 3 s import on a 2-core machine, in
    every trainer's start). MLflow stays importable afterwards (rollstream's tracking)."""
    if "mlflow" in sys.modules:
        return importlib.import_module("deepspeed")
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` fails
    try:
        return importlib.import_module("deepspeed")
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def init_distributed(config: EngineConfig) -> str:
    """Initialise torch.distributed through DeepSpeed once per process; returns the
    accelerator name."""
    accelerator = resolve_accelerator(config)
    # A world of one (no launcher, or variables a parent process left behind: a test run
    # that trained in-process passes RANK=0/WORLD_SIZE=1/MASTER_PORT on to its children)
    # meets in an in-process store (the variables are set for DeepSpeed, which wants
    # them). Under a launcher (WORLD_SIZE > 1, or torchrun's
    # agent store) the launcher's variables are used as they are.
    alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1 and (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    )
    if alone:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
    deepspeed = import_deepspeed()
    if accelerator == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        backend = config.dist_backend or ("nccl" if accelerator == "cuda" else "gloo")
        # deepspeed.comm compiles or re-checks its C++ op here; see build_lock for why
        # it is built under rollstream's build guard first, and the ranks meet outside it.
        root = extensions_root()
        preload_ops(root)
        timeout = datetime.timedelta(seconds=config.dist_timeout_s)
        if alone:  # no rank joins: an in-process store, so the world of one listens on
            # no port (torch's TCPStore binds every interface whatever MASTER_ADDR says);
            # DeepSpeed adopts the initialised group below
            torch.distributed.init_process_group(
                backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        with extensions_dir(root):
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return accelerator


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def deepspeed_config(config: EngineConfig) -> dict[str, Any]:
    """The DeepSpeed config dict for ``config`` (``config.deepspeed`` merged last).

    ``train_micro_batch_size_per_gpu`` is 1 because micro-batches are formed by the
    trainer (whole groups under a token budget), not by a DeepSpeed data loader; the
    value only enters DeepSpeed's sample counters.
    """
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "zero_optimization": {"stage": config.zero_stage},
        "bf16": {"enabled": config.bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if config.grad_clip is not None:
        ds["gradient_clipping"] = config.grad_clip
    return merge_tables(ds, config.deepspeed)


def lr_schedule(optimizer: torch.optim.Optimizer, config: EngineConfig) -> Any:
    """``config``'s ``transformers.get_scheduler`` schedule over ``optimizer``, or ``None``
    for a constant rate without warmup (DeepSpeed then keeps ``lr`` as it is). DeepSpeed
    steps it at every optimiser step and saves its position in each checkpoint."""
    if config.lr_scheduler == "constant" and config.warmup_steps == 0:
        return None
    from transformers import get_scheduler

    name = config.lr_scheduler
    if name == "constant":  # with warmup, as the early return leaves only that case
        name = "constant_with_warmup"
    schedule = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=config.warmup_steps,
        num_training_steps=config.decay_steps,
    )
    if config.lr_scheduler in DECAYING_SCHEDULES and config.decay_steps is not None:
        # transformers' cosine rises again past its end: an RL run outlasting decay_steps
        # keeps the final rate instead
        schedule.lr_lambdas = [_held_after(f, config.decay_steps) for f in schedule.lr_lambdas]
    return schedule


def _held_after(factor: Callable[[int], float], end: int) -> Callable[[int], float]:
    """``factor`` up to step ``end``, then its value at ``end``. A plain function, so
    LambdaLR leaves it out of its state dict (the checkpoint keeps only the position)."""

    def held(step: int) -> float:
        return factor(min(step, end))

    return held


class TrainEngine:
    """A DeepSpeed engine plus what the trainer asks of it.

    ``frozen_copies`` is how many frozen replicas of the *initial* weights the caller
    will ask for (``frozen_copy``): they are deep-copied before DeepSpeed wraps the model
    so they carry no ZeRO hooks. Frozen copies need ZeRO <= 2 (under ZeRO-3 the full
    weights are never materialised on one rank).
    """

    def __init__(
        self, model: torch.nn.Module, config: EngineConfig, *, frozen_copies: int = 0
    ) -> None:
        self.config = config
        self.accelerator = init_distributed(config)
        import deepspeed

        if frozen_copies and config.zero_stage == 3:
            raise ValueError("frozen model copies (EWMA proximal, KL reference) need ZeRO <= 2")
        self._templates = [copy.deepcopy(model) for _ in range(frozen_copies)]
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()  # type: ignore[operator]
        model.train()
        optimizer = torch.optim.AdamW(
            [param for param in model.parameters() if param.requires_grad],  # LoRA: the adapter
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_schedule(optimizer, config),
            config=deepspeed_config(config),
        )
        self.dtype = next(self.engine.module.parameters()).dtype

    # --- properties ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        """Optimiser steps taken (DeepSpeed's counter; restored by ``load_checkpoint``)."""
        return int(self.engine.global_steps)

    # --- training -----------------------------------------------------------------------

    def __call__(self, **kwargs: Any) -> Any:
        """The wrapped model's forward (through DeepSpeed's hooks)."""
        return self.engine(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with DeepSpeed's scaling (÷ grad_accum_steps) and reductions."""
        self.engine.backward(loss)

    def step(self) -> bool:
        """End of a micro-batch; returns True when it stepped the optimiser (boundary)."""
        boundary = bool(self.engine.is_gradient_accumulation_boundary())
        self.engine.step()
        return boundary

    def grad_norm(self) -> float | None:
        """Global gradient norm of the last optimiser step, before clipping."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_peak_lr(self, lr: float) -> None:
        """Make ``lr`` the peak rate of the optimiser and its schedule, at the schedule's
        current position: a checkpoint restores the rate it was saved with, and a fork
        from another run's checkpoint trains with its own."""
        schedule = self.engine.lr_scheduler
        groups = self.optimizer.param_groups
        if schedule is None:
            for group in groups:
                group["lr"] = lr
            return
        schedule.base_lrs = [lr] * len(groups)
        for group, factor in zip(groups, schedule.lr_lambdas, strict=True):
            group["initial_lr"] = lr
            group["lr"] = lr * factor(schedule.last_epoch)

    # --- weights ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights in the training dtype, on the CPU; tied parameters stay
        one tensor (as the weights writer expects). Collective under ZeRO-3: call it on
        every rank (only rank 0 gets the weights)."""
        if self.config.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict()
        copies: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                key = (
                    tensor.untyped_storage().data_ptr(),
                    tensor.storage_offset(),
                    tuple(tensor.shape),
                    tuple(tensor.stride()),
                )
                if key not in copies:  # tied parameters: copied once, still one tensor
                    copies[key] = tensor.cpu()
                tensor = copies[key]
            out[name] = tensor
        return out

    def frozen_copy(self) -> torch.nn.Module:
        """A no-grad, eval-mode copy of the initial weights in the engine's dtype and
        device (for a KL reference or the EWMA proximal policy). Parameters are cast the
        way DeepSpeed casts the trained module (buffers kept), so the copy's numerics match
        it."""
        if not self._templates:
            raise RuntimeError("TrainEngine was built with fewer frozen_copies")
        model = cast_parameters(self._templates.pop(), self.dtype).to(self.device)
        model.eval()
        model.requires_grad_(False)
        return model

    # --- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        """DeepSpeed's checkpoint (weights, fp32 master, optimiser) under
        ``directory/tag``; DeepSpeed's own ``latest`` file is not written (the caller keeps
        an atomic marker). Collective: every rank calls it."""
        self.engine.save_checkpoint(
            str(directory), tag=tag, client_state=client_state, save_latest=False
        )

    def load_checkpoint(self, directory: Path, tag: str) -> dict[str, Any]:
        """Restore weights, optimiser and step counters; returns the client state."""
        path, client_state = self.engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {directory}")
        return dict(client_state or {})

    def rewind(self, directory: Path, tag: str) -> dict[str, Any]:
        """Restore weights, optimiser and schedule from ``tag`` but keep the step counters
        (a guard's rollback: the run's steps go on, ``consumers.guards``); returns the
        client state."""
        engine = self.engine
        counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
        client_state = self.load_checkpoint(directory, tag)
        engine.global_steps, engine.global_samples, engine.micro_steps = counters
        return client_state


def shutdown_distributed(together: bool) -> None:
    """Tear the process group down before the interpreter exits.

    Left to interpreter exit, a gloo group's threads can be destroyed while still joinable
    and the process aborts (SIGABRT), which the launcher reports as a failed rank. With
    ``together`` the ranks first meet, so none tears down while another still talks to it;
    after an error they do not (the others may never arrive)."""
    if not torch.distributed.is_initialized():
        return
    if together:
        barrier()
    torch.distributed.destroy_process_group()


def barrier() -> None:
    """A barrier across ranks (no-op for a world of one)."""
    if torch.distributed.is_initialized() and world_size() > 1:
        torch.distributed.barrier()
