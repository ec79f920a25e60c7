"""Several GPUs: DDP scaling of LoRA on Llama-3.1-8B shapes, and QLoRA on a 70B-shaped model under FSDP2.

One JSON line per measurement (rank 0 prints them; the driver collects and adds the efficiency):

    python3 bench/bench_multigpu.py                   # all: DDP on 1 and N GPUs, then FSDP2 QLoRA on 2
    python3 bench/bench_multigpu.py --gpus 2,4,8      # DDP on 1, 2, 4 and 8 GPUs
    python3 bench/bench_multigpu.py --tiny            # tiny random models, 2 gloo CPU processes (code path only)

DDP: LoRA r=16 on every projection, bf16, batch 8 x 2048 per GPU, our offloaded checkpointing;
tokens/s = GPUs x batch x seq / median step; scaling efficiency = tokens/s(N) / (N x tokens/s(1)),
target >= 0.90 on 2 GPUs. FSDP2: a Llama-3.1-70B-shaped model (hidden 8192, 64 heads, 8 KV heads,
MLP 28672, vocab 128256) with FEWER LAYERS (--layers, 8 by default; the real one has 80) so it is
written and loaded within the call, QLoRA (NF4 stored as bf16, sharded), batch 2 x 2048 per GPU:
peak memory per GPU and tokens/s. Random weights, written once under /tmp. NCCL_NVLS_ENABLE=0 is
forced for the ranks (the lent machines' NVLink multicast must stay off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256),
    "llama70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                     vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def make_model(path: str, shape: str, layers: int | None) -> None:
    """A random-weight Llama of `shape` (bf16 on a GPU) with a word-level tokenizer, written once."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fields = dict(SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False, rope_theta=500000.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t2").save_pretrained(path)


def worker(args) -> None:
    """One rank: load, wrap (DDP) or shard (FSDP2), time steps; rank 0 prints the JSON line."""
    sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "kernels")]
    import torch
    import torch.distributed as dist

    from unsloth import FastLanguageModel
    from unsloth.models.distributed import rank_device, shard_model

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank_device()}" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    model, _ = FastLanguageModel.from_pretrained(args.model_dir, max_seq_length=args.seq, dtype=dtype,
                                                 load_in_4bit=args.four_bit, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, target_modules=TARGETS,
                                             use_gradient_checkpointing="unsloth", random_state=0)
    model.train()
    if args.strategy == "fsdp":
        shard_model(model, mixed_precision=dtype if cuda else None)  # bf16 gathers, float32 reductions
        forward = model
    elif world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    else:
        forward = model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=cuda)
    generator = torch.Generator(device=device).manual_seed(1 + rank)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), device=device, generator=generator)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    median = statistics.median(times)
    if rank == 0:
        print("RESULT " + json.dumps({
            "bench": f"{args.strategy}-{'qlora' if args.four_bit else 'lora'}", "model": args.label, "gpus": world,
            "batch_per_gpu": args.batch, "seq": args.seq, "step_s": round(median, 4),
            "tokens_per_s": round(world * args.batch * args.seq / median, 1),
            "peak_gib_per_gpu": round(float(peak), 2) if cuda else None, "losses": [round(x, 4) for x in losses],
            "device": torch.cuda.get_device_name() if cuda else "cpu"}), flush=True)
    dist.destroy_process_group()


def launch(nprocs: int, worker_args: list[str], tiny: bool) -> dict | None:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    if tiny:
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               os.path.abspath(__file__), "--worker", *worker_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(json.dumps({"error": f"{nprocs} process(es) {' '.join(worker_args)}: exit {done.returncode}",
                          "stderr": done.stderr[-2000:]}), flush=True)
        return None
    result = json.loads(lines[-1])
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", default="2", help="GPU counts for DDP beside 1, comma-separated")
    p.add_argument("--only", choices=["ddp", "fsdp"], help="one of the two benchmarks")
    p.add_argument("--layers", type=int, default=8, help="layers of the 70B-shaped model (the real one: 80)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny models on 2 gloo CPU processes: the code path only")
    # a rank's arguments (set by launch)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--four-bit", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "kernels")]
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    counts = [int(n) for n in args.gpus.split(",")]
    if args.only in (None, "ddp"):
        shape, label = ("tiny", "tiny") if args.tiny else ("llama8b", "Llama-3.1-8B shapes")
        path = os.path.join(tempfile.gettempdir(), f"multigpu-{shape}")
        make_model(path, shape, None)
        size = ["--batch", "2", "--seq", "32"] if args.tiny else ["--batch", "8", "--seq", "2048"]
        common = ["--strategy", "ddp", "--model-dir", path, "--label", label, *size, *timing]
        one = launch(1, common, args.tiny)
        for n in counts:
            result = launch(n, common, args.tiny)
            if one and result:
                print(json.dumps({"bench": "ddp-scaling", "gpus": n, "tokens_per_s_1": one["tokens_per_s"],
                                  "tokens_per_s_n": result["tokens_per_s"],
                                  "efficiency": round(result["tokens_per_s"] / (n * one["tokens_per_s"]), 3),
                                  "target": 0.90 if n == 2 else None}), flush=True)
    if args.only in (None, "fsdp"):
        layers = 2 if args.tiny else args.layers
        shape = "tiny" if args.tiny else "llama70b"
        path = os.path.join(tempfile.gettempdir(), f"multigpu-{shape}-{layers}layers")
        make_model(path, shape, layers)
        label = "tiny" if args.tiny else f"Llama-3.1-70B shapes, {layers} of 80 layers"
        size = ["--batch", "2", "--seq", "32"] if args.tiny else ["--batch", "2", "--seq", "2048"]
        launch(2, ["--strategy", "fsdp", "--four-bit", "--model-dir", path, "--label", label, *size, *timing],
               args.tiny)


if __name__ == "__main__":
    main()
