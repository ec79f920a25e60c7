"""Several processes, one per GPU (torchrun / accelerate launch): where this rank's model lives, and
FSDP2 sharding of our patched models.

Data parallel (DDP) needs nothing here beyond placement: the Trainer (accelerate) wraps the model,
and our checkpointed layers hand their gradients to the autograd engine like any layer
(models/checkpointing.py). FSDP2 (`shard_model`) is for models that do not fit one GPU.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from unsloth.models.checkpointing import decoder_layers

log = logging.getLogger("unsloth")


def world_size() -> int:
    """How many processes this job has (torchrun and accelerate set WORLD_SIZE); 1 outside one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@functools.cache  # registered once
def destroy_process_group_at_exit() -> None:
    """At the interpreter's exit, destroy the job's gloo process group while Python is still whole, as
    PyTorch asks every job to (notebooks never do): left to the teardown it can abort the rank ("terminate
    called without an active exception") as its worker threads free their last work's tensors. NCCL's is
    left alone: after an interrupt its shutdown could wait on a collective the other ranks never finish.
    Nothing to do where the script destroyed the group already."""
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        # A gloo worker frees its last collective's tensors under the GIL; let it have the GIL before the
        # group's destructor joins that worker while holding it.
        time.sleep(0.05)
        try:
            dist.destroy_process_group()
        except Exception as error:  # at exit a failure here must not hide the script's own outcome
            log.warning("unsloth: destroying the process group at exit failed (%s: %s)", type(error).__name__, error)


def rank_device() -> int:
    """The GPU this process trains on: its local rank's under a launcher, else the current one.

    Made current too, so that allocations without a device (pinned buffers' streams, NCCL) land there.
    """
    index = local_rank() if world_size() > 1 else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return index


def parse_cpulist(text: str) -> list[int]:
    """Linux's CPU list format ("0-3,8,10-11") as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def gpu_local_cpus(device_index: int, sysfs: Path = Path("/sys/bus/pci/devices")) -> list[int]:
    """The CPUs on the GPU's NUMA node, as the kernel tells (sysfs); [] when it cannot tell."""
    try:
        props = torch.cuda.get_device_properties(device_index)
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return parse_cpulist((sysfs / address / "local_cpulist").read_text())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return []


def bind_to_gpu_numa_node(device_index: int) -> list[int]:
    """Run this rank on the CPUs next to its GPU, so the pinned host buffers it first touches (the
    offloaded activations) are allocated on that NUMA node. Only when several ranks share the host
    and psutil can set the affinity; the CPUs kept are those also allowed now. Returns them ([]: unchanged)."""
    import psutil

    cpus = gpu_local_cpus(device_index)
    process = psutil.Process()
    if not cpus or world_size() == 1 or not hasattr(process, "cpu_affinity"):
        return []
    allowed = set(process.cpu_affinity())
    chosen = sorted(allowed & set(cpus))
    if not chosen or set(chosen) == allowed:
        return []
    process.cpu_affinity(chosen)
    return chosen


def shard_model(model: nn.Module, mixed_precision: torch.dtype | None = None, reshard_after_forward: bool = True):
    """Shard a (PEFT or plain) model with FSDP2: each decoder layer is one group, the rest (embeddings,
    final norm, head) the root's. Call it in every rank after loading (and after get_peft_model).

    `mixed_precision`: the dtype the layers compute in (weights gathered in it), gradients reduced
    in float32. A QLoRA base shards when its 4-bit weights are stored in the compute dtype
    (the loader does this in a distributed run: bitsandbytes' quant-storage dtype), so one layer's
    parameters share a dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = decoder_layers(base)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    log.info("unsloth: FSDP2 sharded %d decoder layers over %d processes", len(layers), world_size())
    return model


def _sharded_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return bool(_sharded_modules(model))


@contextmanager
def gathered(model: nn.Module):
    """Inside, every weight of an FSDP2-sharded model is whole (gathered once, on every rank: a
    collective, so every rank enters); a model that is not sharded is left as it is. Yields whether
    it gathered: the whole weights are views of buffers freed on leaving, so keep copies."""
    groups = _sharded_modules(model)
    for group in groups:
        group.unshard()
    try:
        yield bool(groups)
    finally:
        for group in groups:
            group.reshard()


def _state_dict_options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # The trainable weights only: a LoRA checkpoint does not carry the frozen base again.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save_sharded(model: nn.Module, optimizer, directory: str | Path) -> None:
    """A sharded checkpoint (torch.distributed.checkpoint): each rank writes its own shards of the
    trainable weights and their optimizer state, in parallel; every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=_state_dict_options())
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(directory))


def load_sharded(model: nn.Module, optimizer, directory: str | Path) -> None:
    """Resume from `save_sharded`'s checkpoint, into a model sharded the same way (any rank count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, optim = get_state_dict(model, optimizer, options=_state_dict_options())
    state = {"model": weights, "optim": optim}
    dcp.load(state, checkpoint_id=str(directory))
    # Not strict about the frozen weights left out; dcp.load has already insisted on every trainable one.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_dict_options(strict=False))


def full_state_dict(model: nn.Module, trainable_only: bool) -> dict:
    """The whole weights of an FSDP2-sharded model (`trainable_only`: the trained ones), gathered one
    tensor at a time into rank 0's host memory; every rank calls it, the others get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)
