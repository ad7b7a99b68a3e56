"""Distributed helpers that accelerate cannot do for us: the frozen target is not `Trainer.model` (optimizer,
checkpoints and DDP/FSDP see only the draft), so under FSDP its decoder layers are sharded here with torch
FSDP2 `fully_shard`. The draft is sharded by accelerate's own FSDP2 path (`examples/accelerate/fsdp2.yaml`).

Only the decoder layers are sharded (the bulk of the target's weights). The embedding, final norm and lm_head
stay replicated: the draft reads them directly, outside the target's forward (block embeddings, the chunked
lm_head + CE, `target_argmax` labels), where FSDP would not have gathered them.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dflash_hf.targets.frozen import FrozenTarget


def shard_frozen_target_layers(target: FrozenTarget, mesh: DeviceMesh | None = None) -> int:
    """`fully_shard` every decoder layer of the frozen target over `mesh` (default: all ranks of the
    default process group, on the target's device type). Each layer's weights are all-gathered for its
    forward and freed after it (`reshard_after_forward=True`); tap hooks on the layers keep working. Its forward
    then gathers weights, so it is not captured as a CUDA graph (`target_cuda_graph=True` is refused).
    Returns the number of sharded layers."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    graphs = target.forward_graphs
    if graphs is not None and graphs.setting:
        raise ValueError(
            "target_cuda_graph=True: the frozen target's layers are sharded (FSDP2) and its forward "
            "gathers their weights, which is not captured; leave target_cuda_graph unset or false"
        )
    target.forward_graphs = None
    if not torch.distributed.is_initialized():
        raise RuntimeError("sharding the frozen target needs an initialized process group (torchrun / accelerate)")
    if mesh is None:
        mesh = init_device_mesh(target.device.type, (torch.distributed.get_world_size(),))
    count = 0
    for layer in target.layers:
        if not isinstance(layer, FSDPModule):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
            count += 1
    return count


def accelerator_uses_fsdp2(accelerator) -> bool:
    """True when accelerate was launched with an FSDP2 plugin (`fsdp_version: 2`)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return plugin is not None and getattr(plugin, "fsdp_version", 1) == 2


__all__ = ["shard_frozen_target_layers", "accelerator_uses_fsdp2"]
