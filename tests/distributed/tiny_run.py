"""One tiny training run, in one process or as a rank of a torchrun job (2 gloo processes on the CPU).

    python -m torch.distributed.run --nproc-per-node 2 tiny_run.py ddp|fsdp lora|qlora|full MODEL_DIR OUT.pt [OPTIONS]

Every rank takes its slice of the same global batch; rank 0 writes the step losses (averaged over
the ranks) and the first step's full gradients of the trainable weights, to compare with
`single_process_run` on the whole batch.
"""

from __future__ import annotations

import os
import sys

import torch

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3


def build(model_dir: str, kind: str):
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(model_dir, max_seq_length=64, dtype=torch.float32,
                                                 load_in_4bit=kind == "qlora", full_finetuning=kind == "full",
                                                 use_gradient_checkpointing="unsloth")
    if kind != "full":
        model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, random_state=0,
                                                 use_gradient_checkpointing="unsloth")
        torch.manual_seed(1)
        with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.1)
    model.train()
    return model


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def train(model, forward, rank: int = 0, world: int = 1, reduce=lambda x: x, full=lambda g: g,
          first: int = 0, last: int = STEPS, resume=None, save=None):
    """AdamW steps `first`..`last` - 1 on this rank's rows of each global batch: their losses and the
    first one's gradients. `resume(optimizer)` loads a checkpoint before; `save(optimizer)` writes one after."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    if resume is not None:
        resume(optimizer)
    rows = GLOBAL_BATCH // world
    losses, first_grads = [], None
    for ids in batches(model.config.vocab_size)[first:last]:
        ids = ids[rank * rows:(rank + 1) * rows]
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(reduce(loss.detach()).item())
        if first_grads is None:
            first_grads = {n: full(p.grad).detach().clone() for n, p in trainable.items()}
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        save(optimizer)
    return {"losses": losses, "grads": first_grads}


def single_process_run(model_dir: str, kind: str, merged_dir: str | None = None) -> dict:
    model = build(model_dir, kind)
    result = train(model, model)
    if merged_dir:
        model.save_pretrained_merged(merged_dir)
    return result


def main(strategy: str, kind: str, model_dir: str, out: str, *options: str) -> None:
    """options: "merged=DIR" (save merged weights after), "stop=N" + "checkpoint=DIR" (train steps
    0..N-1 and save a sharded checkpoint), "resume=DIR" + "start=N" (load it and train from step N)."""
    import torch.distributed as dist

    from unsloth.models import distributed

    settings = dict(option.split("=", 1) for option in options)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(model_dir, kind)

    def mean(t):
        dist.all_reduce(t)
        return t / world

    if strategy == "ddp":
        # find_unused_parameters=True: what the Trainer chooses for a PeftModel.
        forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        result = train(model, forward, rank, world, mean)
    else:
        distributed.shard_model(model)
        checkpoint = settings.get("checkpoint")
        result = train(model, model, rank, world, mean, full=lambda g: g.full_tensor(),
                       first=int(settings.get("start", 0)), last=int(settings.get("stop", STEPS)),
                       resume=(lambda o: distributed.load_sharded(model, o, settings["resume"]))
                       if "resume" in settings else None,
                       save=(lambda o: distributed.save_sharded(model, o, checkpoint)) if checkpoint else None)
    if "merged" in settings:
        model.save_pretrained_merged(settings["merged"])  # every rank: the gather is a collective
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()
    # Exit without Python's teardown: there the DDP reducer's destructor (holding the GIL) joins gloo's worker
    # thread while that thread waits for the GIL to free a finished all-reduce's tensors, and now and then the
    # rank never exits (native stacks seen: ~Reducer -> ~ProcessGroupGloo -> thread::join, and
    # ~AsyncAllreduceWork -> decref_pyobject -> gil_scoped_acquire).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
