"""How the process was launched: checks that a launch does what it says, and CPU thread counts.

- :func:`check_launch`: `torchrun --nproc_per_node N` on a machine without an accelerator runs DDP on CPU over
  gloo (instead of N independent trainings); `accelerate launch --cpu --num_processes N` (which starts ONE
  process) is refused with the command that starts N; an FSDP accelerate config without a GPU (which would
  train DDP) is refused.
- :func:`configure_cpu_threads`: intra-op threads per process from the cores this process may use, the number
  of processes on this machine and the machine's load (`OMP_NUM_THREADS` overrides), so several processes or
  a busy machine do not oversubscribe the cores.
- :func:`no_hf_progress_bars`: hides transformers' own bars (e.g. save_pretrained's "Writing model shards")
  while a checkpoint is saved, so they do not break the training progress bar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("dflash_hf")

THREADS_ENV = "OMP_NUM_THREADS"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


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
    world = _env_int("WORLD_SIZE", 1)
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


def cpu_threads(local_world_size: int | None = None, max_threads: int | None = None) -> int:
    """Intra-op threads for one process: `OMP_NUM_THREADS` when set; else the cores this process may run on,
    shared by the processes of this machine (`LOCAL_WORLD_SIZE`), less the cores other work keeps busy (the
    1-minute load average), at most `max_threads`, at least 1."""
    explicit = _env_int(THREADS_ENV, 0)
    if explicit > 0:
        return explicit
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = local_world_size or _env_int("LOCAL_WORLD_SIZE", 1)
    per_process = max(1, cores // max(local, 1))
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    idle = int(cores - busy + 0.5)  # cores other processes leave free (this one has not started work yet)
    return max(1, min(per_process, idle, max_threads or per_process))


def configure_cpu_threads(max_threads: int | None = None) -> int:
    """Set torch's intra-op threads to :func:`cpu_threads` and return the count (console scripts call it)."""
    import torch

    n = cpu_threads(max_threads=max_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.info("using %d CPU threads per process (set %s to override)", n, THREADS_ENV)
    return n


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


__all__ = ["check_launch", "configure_cpu_threads", "cpu_threads", "has_accelerator", "no_hf_progress_bars"]
