"""Decoding speed after training: LoRA adapters attached, `for_inference`, then greedy `generate`.

One JSON line per batch size: {"impl", "batch", "prompt", "new", "four_bit", "tokens_per_s", ...}.
`--impl ours|unsloth` both load through `from unsloth import FastLanguageModel`: which package
answers is PYTHONPATH's choice (ours: src first; Unsloth: .anchors/site only), as bench/h200.sh
runs them. `--impl hf` is transformers + PEFT, `model.eval()` and plain `generate`.

On the H200 (Llama-3.1-8B shapes written by `.anchors/anchor_lora.py --impl make` to /tmp/llama8b):
    python3 bench/bench_generation.py --impl ours [--four-bit]
On the CPU, the same logic on a tiny random Llama:
    python3 bench/bench_generation.py --impl ours --tiny
`--sync-every-step` (ours) makes the host wait for every decode step again, as transformers does on
CUDA: the A/B of our deferred stop check in one call. `--profile` adds `device_ms_per_step`, the GPU's
kernel time per step from one more call under torch.profiler, beside `wall_ms_per_step`, and
`top_kernels`: the 16 kernels with the most time per step (name cut to 80 characters, ms per step).
`prefill_s` is a call making one new token (the prompt's forward and one step), and
`decode_wall_ms_per_step` the timed call's wall time less that, per further token: the steps alone.
`--host-profile` adds `host_top`: one more call under cProfile, the 20 functions with the most own
host time per decode step (ms; the prompt's forward spread over the steps, as in the other columns),
to see what paces a step whose wall time exceeds its GPU time. Unsloth's plain `generate` decodes
eagerly; `UNSLOTH_DECODE_CUDA_GRAPHS=1` gives it the CUDA-graph step its GRPO rollouts use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", required=True, choices=["ours", "unsloth", "hf"])
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "llama8b"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--warmup-new", type=int, default=16, help="tokens of the untimed call (compiles, captures)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (checks the logic)")
    p.add_argument("--sync-every-step", action="store_true",
                   help="ours: the host waits for every decode step, as transformers does on CUDA (the A/B of the "
                        "deferred stop check)")
    p.add_argument("--nf4-tuning", metavar="FILE",
                   help="ours: nf4_matmul's launch configurations from bench/nf4_matmul.py --tuning-out (same call)")
    p.add_argument("--host-profile", action="store_true",
                   help="one more call under cProfile: the host's functions with the most own time per decode step")
    p.add_argument("--sample", action="store_true",
                   help="also time a seeded sampled call (top_k=0: GRPO's rollouts) after the greedy one")
    p.add_argument("--profile", action="store_true",
                   help="more calls under torch.profiler: the GPU's kernel time per decode step beside the wall time, "
                        "and the host's ops")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompt, args.new, args.warmup_new = min(args.prompt, 24), min(args.new, 8), 2
    return args


def write_tiny(directory: str) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1", pad_token="t2",
                            unk_token="t0").save_pretrained(directory)
    return directory


def load(args, device: str):
    """The model with LoRA adapters attached (B non-zero, so they change the tokens), ready to generate."""
    import torch

    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.impl in ("ours", "unsloth"):
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=args.model_dir, max_seq_length=args.prompt + args.new,
                                                     dtype=dtype, load_in_4bit=args.four_bit, local_files_only=True)
        model = FastLanguageModel.get_peft_model(model, r=args.rank, lora_alpha=args.rank, lora_dropout=0,
                                                 bias="none", target_modules=TARGETS,
                                                 use_gradient_checkpointing="unsloth", random_state=0)
        _nonzero_adapters(model)
        FastLanguageModel.for_inference(model)
        return model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=dtype, attn_implementation="sdpa", device_map=device)
    if args.four_bit:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kw)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    _nonzero_adapters(model)
    return model.eval()


def _nonzero_adapters(model):
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 1e-3)


def measure(model, args, batch: int, device: str) -> dict:
    import torch

    vocab = model.config.get_text_config().vocab_size  # a smaller model's ids stay in its vocabulary
    ids = torch.randint(3, min(250 if args.tiny else 128000, vocab), (batch, args.prompt),
                        generator=torch.Generator().manual_seed(batch)).to(device)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    # min_new_tokens: random weights may emit EOS early; every impl decodes exactly `new` tokens
    options = dict(do_sample=False, pad_token_id=2 if args.tiny else 128004)

    def generate(new, **sampling):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, **{**options, **sampling})
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    start = time.perf_counter()
    generate(args.warmup_new)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out = generate(args.new)
    seconds = time.perf_counter() - start
    new_tokens = out[:, args.prompt:]
    assert new_tokens.shape[1] == args.new, new_tokens.shape
    sampled = {}
    if args.sample:
        torch.manual_seed(0)
        start = time.perf_counter()
        generate(args.new, do_sample=True, top_k=0, temperature=1.0)
        sampled_s = time.perf_counter() - start
        sampled = {"sampled_tokens_per_s": round(batch * args.new / sampled_s, 2),
                   "sampled_wall_ms_per_step": round(1000 * sampled_s / args.new, 3)}
    profiled = device_time(generate, args.new) if args.profile else {}
    if args.host_profile:
        profiled["host_top"] = host_time(generate, args.new)
    return {"impl": args.impl, "batch": batch, "prompt": args.prompt, "new": args.new, "four_bit": args.four_bit,
            "sync_every_step": args.sync_every_step, "nf4_decode": os.environ.get("UNSLOTH_NF4_DECODE") != "0",
            "nf4_sum_in_graph": os.environ.get("UNSLOTH_NF4_SUM_IN_GRAPH", "1") != "0",
            "nf4_unroll_rank": int(os.environ.get("UNSLOTH_NF4_UNROLL_RANK", "16")),
            "wall_ms_per_step": round(1000 * seconds / args.new, 3), "prefill_s": round(prefill_s, 3),
            "decode_wall_ms_per_step": round(1000 * (seconds - prefill_s) / max(args.new - 1, 1), 3), **sampled,
            **profiled, **compile_report(model),
            "tokens_per_s": round(batch * args.new / seconds, 2), "seconds": round(seconds, 3),
            "first_call_s": round(first_s, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
            # greedy tokens of row 0, to compare impls (bf16 rounding may part them after a while)
            "tokens_sha": hashlib.sha1(str(new_tokens[0].tolist()).encode()).hexdigest()[:12]}


def host_time(generate, new: int) -> list:
    """The 20 host functions with the most own time in one call under cProfile, ms per decode step."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(generate, new)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:20]
    return [[f"{os.path.basename(file)}:{line}:{name}"[:80], round(1000 * own / new, 3), calls]
            for (file, line, name), (calls, _, own, _, _) in rows]


def use_nf4_tuning(path: str) -> None:
    """nf4_matmul's launch configurations from `bench/nf4_matmul.py --tuning-out` (run in the same call)."""
    from unsloth_kernels import nf4_matmul

    with open(path) as f:
        nf4_matmul.NF4_MATMUL_TUNING.update({kind: tuple(config) for kind, config in json.load(f).items()})


def dynamo_counts() -> dict:
    """Graphs torch.compile made so far in this process, and graph breaks it met: a decode step that
    breaks into pieces costs several times its time, and otherwise shows only as a slow row."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def compile_report(model) -> dict:
    """dynamo_counts, whether our decode fell back to eager (compilation failed: a warning says why), and
    torch.compile's time so far by phase, the 12 longest (nested: a phase's time includes those it calls)."""
    from torch._dynamo.utils import compilation_time_metrics

    phases = sorted(((name, sum(times)) for name, times in compilation_time_metrics.items()), key=lambda row: -row[1])
    return {**dynamo_counts(),
            "eager_decode": any(m.__dict__.get("_unsloth_eager_decode", False) for m in model.modules()),
            "compile_s_by_phase": {name: round(seconds, 2) for name, seconds in phases[:12]}}


def device_time(generate, new: int) -> dict:
    """Kernel time on the GPU per decode step (the prefill spread over the steps), from one more call
    under torch.profiler: far below the wall time per step means the host paces decoding; the kernels
    that take it; and, from another call, the host's torch ops and CUDA runtime calls by own time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {"device_ms_per_step": None, "top_kernels": None}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(new)
    events = sorted(prof.key_averages(), key=lambda event: event.self_device_time_total, reverse=True)
    per_step = [(event.key[:80], event.self_device_time_total / 1000 / new) for event in events]
    # and the host's side in a call of its own (the CPU events slow it): torch ops and CUDA runtime calls (these
    # come with the CUDA activity) by own time, where a synchronize or a graph launch that waits shows as waiting
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as host:
        generate(new)
    calls = sorted(host.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    return {"device_ms_per_step": round(sum(ms for _, ms in per_step), 3),
            "top_kernels": [[name, round(ms, 3)] for name, ms in per_step[:16]],
            "host_events_top": [[event.key[:60], round(event.self_cpu_time_total / 1000 / new, 3), event.count]
                                for event in calls[:16]]}


def main(argv=None):
    args = arguments(argv)
    if args.impl == "ours" or args.impl == "unsloth":
        import unsloth  # noqa: F401  (before transformers, as notebooks do)
    if args.sync_every_step and args.impl == "ours":
        from unsloth.models import generation

        generation.DEFER_DEVICES = set()
    if args.nf4_tuning and args.impl == "ours":
        use_nf4_tuning(args.nf4_tuning)
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            args.model_dir = write_tiny(tmp)
        start = time.perf_counter()
        model = load(args, device)
        load_s = time.perf_counter() - start
        for batch in args.batch:
            print(json.dumps({**measure(model, args, batch, device), "load_s": round(load_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
