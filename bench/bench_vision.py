"""Vision SFT on a Qwen2.5-VL-7B-shaped model: ours or Unsloth's FastVisionModel, one per process.

    python3 bench/bench_vision.py --impl make                 # writes the model + processor once
    python3 bench/bench_vision.py --impl ours                 # our FastVisionModel (our source first)
    python3 bench/bench_vision.py --impl unsloth              # the public Unsloth (anchors' site first)
    python3 bench/bench_vision.py --tiny --impl make && python3 bench/bench_vision.py --tiny --impl ours  # CPU

Random weights at Qwen2.5-VL-7B's sizes (text: hidden 3584, MLP 18944, 28 heads / 4 KV heads, vocab
152064; vision: 32 blocks of hidden 1280) with fewer layers so a run fits about a minute on an H200:
`text_layers` / `vision_layers` in the output say how many (defaults 28 / 32). QLoRA (NF4), LoRA r 16
on both towers' attention and MLP (finetune_vision_layers=True), batch 2, one 448x448 image each
(256 image tokens) and a caption of about 200 tokens, through each side's UnslothVisionDataCollator.
The loop: collate, forward with labels, backward, fused AdamW; median of the steps after the warm-up
(the collator's time is apart, `collate_s`), peak = torch.cuda.max_memory_allocated(). `ours` and
`unsloth` both `import unsloth`: PYTHONPATH decides which (`unsloth_from` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True, choices=["make", "ours", "unsloth"])
p.add_argument("--text-layers", type=int, default=8)
p.add_argument("--vision-layers", type=int, default=8)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--image-size", type=int, default=448)
p.add_argument("--caption-words", type=int, default=200)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--tiny", action="store_true", help="a CPU-sized model, to check the code path")
p.add_argument("--model-dir", default=None)
args = p.parse_args()

if args.impl == "ours":  # our source, wherever the script is run from
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path[:0] = [os.path.join(root, "src"), os.path.join(root, "kernels")]
if args.impl != "make":
    import unsloth  # noqa: F401  (before transformers, as Unsloth asks)

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
MODEL_DIR = args.model_dir or os.path.join(tempfile.gettempdir(), "qwen2_5_vl_7b_bench" + ("_tiny" if args.tiny else ""))
WORDS = 2000
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sizes():
    if args.tiny:
        text = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=WORDS + len(SPECIAL), rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 4]})
        vision = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    else:
        text = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                    vocab_size=152064, rope_scaling={"rope_type": "default", "mrope_section": [16, 24, 24]},
                    rope_theta=1000000.0)
        vision = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
    return text, vision


def make() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil
    from transformers.utils import is_torchvision_available

    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({t: WORDS + i for i, t in enumerate(SPECIAL)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="w0", chat_template=TEMPLATE, padding_side="right")
    pixels = args.image_size * args.image_size
    size = {"shortest_edge": pixels, "longest_edge": pixels}
    if is_torchvision_available():
        from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        images, video = Qwen2VLImageProcessor(size=size), Qwen2VLVideoProcessor()
        processor = Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=video,
                                        chat_template=TEMPLATE)
    else:
        from unsloth.models.vision import without_video  # noqa: E402  (make runs from the repo root)

        images = Qwen2VLImageProcessorPil(size=size)
        processor = without_video(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tokenizer,
                                                       video_processor=None, chat_template=TEMPLATE)
    text, vision = sizes()
    config = Qwen2_5_VLConfig(
        text_config=dict(**text, num_hidden_layers=args.text_layers, max_position_embeddings=32768,
                         eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(**vision, depth=args.vision_layers, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < args.vision_layers] or [0]),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(MODEL_DIR)
    processor.save_pretrained(MODEL_DIR)
    print(json.dumps({"impl": "make", "dir": MODEL_DIR, "params_b": sum(p.numel() for p in model.parameters()) / 1e9}))


def examples(n: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        image = Image.fromarray(rng.integers(0, 255, (args.image_size, args.image_size, 3), dtype=np.uint8))
        caption = " ".join(f"w{int(w)}" for w in rng.integers(10, WORDS, args.caption_words))
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "w1 w2 w3"}]},
            {"role": "assistant", "content": [{"type": "text", "text": caption}]}]})
    return out


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench() -> None:
    from unsloth import FastVisionModel
    from unsloth.trainer import UnslothVisionDataCollator

    model, processor = FastVisionModel.from_pretrained(
        MODEL_DIR, load_in_4bit=DEVICE == "cuda", dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16,
        use_gradient_checkpointing="unsloth", max_seq_length=2048, local_files_only=True)
    model = FastVisionModel.get_peft_model(
        model, finetune_vision_layers=True, finetune_language_layers=True, finetune_attention_modules=True,
        finetune_mlp_modules=True, r=args.rank, lora_alpha=args.rank, lora_dropout=0, bias="none",
        random_state=3407, use_gradient_checkpointing="unsloth")
    FastVisionModel.for_training(model)
    collator = UnslothVisionDataCollator(model, processor)
    data = examples(args.batch * (args.warmup + args.steps))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=DEVICE == "cuda")
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    from profiling import kernel_profile  # BENCH_PROFILE=1: the last step's kernels

    times, collate, losses, tokens = [], [], [], 0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        batch = collator(data[i * args.batch:(i + 1) * args.batch])
        batch = {k: v.to(DEVICE) if hasattr(v, "to") else v for k, v in batch.items()}
        sync()
        t1 = time.perf_counter()
        with kernel_profile(f"vision {args.impl}", enabled=i == args.warmup + args.steps - 1):
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        losses.append(float(out.loss))
        if i >= args.warmup:
            times.append(time.perf_counter() - t1)
            collate.append(t1 - t0)
            tokens = int(batch["input_ids"].numel())
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
    print(json.dumps({
        "impl": args.impl, "model": "qwen2_5_vl-7b-shaped", "shape": "qlora" if DEVICE == "cuda" else "cpu-tiny",
        "batch": args.batch, "tokens_per_batch": tokens, "image": args.image_size,
        "text_layers": args.text_layers, "vision_layers": args.vision_layers, "default_layers": [28, 32],
        "median_step_s": statistics.median(times), "collate_s": statistics.median(collate), "peak_gib": peak,
        "losses": [round(x, 4) for x in losses], "unsloth_from": os.path.dirname(unsloth.__file__),
    }))


if __name__ == "__main__":
    make() if args.impl == "make" else bench()
