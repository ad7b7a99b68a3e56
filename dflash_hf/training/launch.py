"""How the process was launched: checks that a launch does what it says (the CPU threads per process are
`dflash_hf.ops.cpu_threads`).

- :func:`check_launch`: `torchrun --nproc_per_node N` on a machine without an accelerator runs DDP on CPU over
  gloo (instead of N independent trainings); `accelerate launch --cpu --num_processes N` (which starts ONE
  process) is refused with the command that starts N; an FSDP accelerate config without a GPU (which would
  train DDP) is refused.
- :func:`no_hf_progress_bars`: hides transformers' own bars (e.g. save_pretrained's "Writing model shards")
  while a checkpoint is saved, so they do not break the training progress bar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from dflash_hf.ops.cpu_threads import env_int

logger = logging.getLogger("dflash_hf")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def has_accelerator() -> bool:
    """True when torch sees a CUDA (or other torch.accelerator) device."""
    import torch

    if torch.cuda.is_available():
        return True
    accel = getattr(torch, "accelerator", None)
    return bool(accel is not None and accel.is_available())


def check_launch(args) -> None:
    """Make a multi-process launch do what it says (call before the devices are set up).

    Under a distributed launcher (`WORLD_SIZE` > 1) without an accelerator, `args.use_cpu` is set so the
    processes form one gloo DDP group on CPU. A single process started by `accelerate launch --cpu
    --num_processes N` (accelerate's simple launcher exports `MASTER_ADDR` but starts one process) is an
    error naming the commands that start N CPU processes."""
    world = env_int("WORLD_SIZE", 1)
    if _truthy("ACCELERATE_USE_FSDP") and (args.use_cpu or not has_accelerator()):
        raise ValueError(
            f"launched with an FSDP accelerate config (FSDP_VERSION={os.environ.get('FSDP_VERSION', '1')}, e.g. "
            "examples/accelerate/fsdp2.yaml) but without a GPU: FSDP shards over GPUs, and on the CPU the run would "
            "train with DDP instead. Launch on GPUs, or say DDP: `accelerate launch --config_file "
            "examples/accelerate/ddp.yaml ...` or `torchrun --nproc_per_node N -m dflash_hf.cli.train ...` (without a "
            "GPU both train with DDP on CPU over gloo)"
        )
    if world > 1:
        if not args.use_cpu and not has_accelerator():
            logger.warning("launched with WORLD_SIZE=%d and no GPU: training with DDP on CPU (gloo)", world)
            args.use_cpu = True
        return
    if _truthy("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and "LOCAL_RANK" not in os.environ:
        raise ValueError(
            "`accelerate launch --cpu --num_processes N` starts a single process (accelerate's --cpu uses its "
            "one-process launcher). For N CPU processes run `accelerate launch --multi_gpu --num_processes N "
            "-m dflash_hf.cli.train ...` or `torchrun --nproc_per_node N -m dflash_hf.cli.train ...` (without a "
            "GPU they train with DDP on CPU over gloo); for one process drop --num_processes"
        )


@contextmanager
def no_hf_progress_bars() -> Iterator[None]:
    """transformers (and huggingface_hub) progress bars off inside the block, restored after it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


__all__ = ["check_launch", "has_accelerator", "no_hf_progress_bars"]
