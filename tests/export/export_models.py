"""Tiny random-weight models of every supported architecture, with a locally trained tokenizer.

Random tiny models have many near ties between their top logits, which would make "identical
greedy tokens" a coin toss rather than a check. Two adjustments make it a real check: the final
norm is scaled up (logits spread out, as in trained models), and weights are rounded to float16
so that an f16 export holds exactly the weights transformers runs, and any difference comes from
the conversion. Gemma ties its input and output embeddings and scales inputs by sqrt(hidden): at
random init every token then predicts itself, so its embeddings are shrunk.
"""

from __future__ import annotations

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")

COMMON = dict(
    vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.02,
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
# What the later additions use: hidden 64, 2 layers (COMMON's hidden 256 predates them; CI time)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
PER_ARCH = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=64),
    "gemma": dict(head_dim=64),
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64),
}
# Families our converter does not write: exported through llama.cpp's own converter. Shapes as the
# released models have them where llama.cpp assumes them (Qwen3-MoE renormalizes its top-k weights).
_HYBRID = dict(head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=128)
LLAMA_CPP_PER_ARCH = {
    "qwen3_5_text": _HYBRID,
    "gpt_oss": dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, intermediate_size=256,
                    layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(head_dim=64, num_experts=4, norm_topk_prob=True, **_EXPERTS),
    "phi3": dict(pad_token_id=None),
    "smollm3": dict(pad_token_id=None),
    "olmo2": {},
    "olmo3": {},
    "granite": dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0),
    "ministral3": dict(head_dim=64),
    # Gemma 4 text: per-layer input embeddings, a sliding and a full layer (llama.cpp's gemma4 graph)
    "gemma4_text": dict(head_dim=64, global_head_dim=128, sliding_window=64, vocab_size_per_layer_input=384,
                        hidden_size_per_layer_input=16, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=2),
    "glm4": dict(head_dim=64, pad_token_id=None),  # GLM-4 dense: post-norms, partial interleaved rotary
    "glm": dict(TINY, head_dim=16, pad_token_id=None),  # GLM: fused gate-up MLP, partial interleaved rotary
    # Granite 4 dense (attention layers only, no experts: the released dense ones say top-k 0)
    "granitemoehybrid": dict(TINY, shared_intermediate_size=128, num_local_experts=0, num_experts_per_tok=0,
                             layer_types=["attention", "attention"], position_embedding_type="rope",
                             residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0),
}
# The MoE families exported with LoRA on their experts (test_export_moe), at the tiny sizes of TINY.
# Where llama.cpp fixes a shape, as the released models have it: OLMoE's key norm spans every head
# (no grouped-query attention), Llama 4 has no RoPE on every 4th layer (so 4 layers).
_TINY_EXPERTS = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MOE_PER_ARCH = {
    "olmoe": dict(TINY, head_dim=16, num_key_value_heads=4, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(TINY, shared_expert_intermediate_size=64, num_experts=4, **_TINY_EXPERTS),
    "deepseek_v3": dict(TINY, num_key_value_heads=4, n_routed_experts=4, n_group=2, topk_group=1, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, **_TINY_EXPERTS),
    "glm4_moe": dict(TINY, head_dim=16, n_routed_experts=4, n_group=2, topk_group=1, n_shared_experts=1,
                     first_k_dense_replace=1, **_TINY_EXPERTS),
    # Qwen3.5-MoE: head_dim 64 as Qwen3.5's, whose rotary sections llama.cpp asserts fit the rotated part
    "qwen3_5_moe_text": dict(TINY, **_HYBRID, num_experts=4, shared_expert_intermediate_size=32, **_TINY_EXPERTS),
    "llama4_text": dict(TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1),
}
PER_ARCH.update(LLAMA_CPP_PER_ARCH)
PER_ARCH.update(MOE_PER_ARCH)
LLAMA_CPP_ARCHITECTURES = tuple(LLAMA_CPP_PER_ARCH)
# transformers loads a Qwen 3.5 (MoE) folder's tokenizer as Qwen3_5Tokenizer, with Qwen 3.5's own split
# rule whatever tokenizer.json says: the tiny tokenizer is trained with that rule, as the real one is
def qwen35_split() -> str:
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


SPLIT_RULES = {"qwen3_5_moe_text": qwen35_split}
# Special tokens llama.cpp's converters look up by name: GLM's set EOS, BOS and EOT from these
EXTRA_SPECIALS = {"glm4": ("<|endoftext|>", "<|user|>"), "glm": ("<|endoftext|>", "<|user|>"),
                  "glm4_moe": ("<|endoftext|>", "<|user|>", "[gMASK]", "<|observation|>")}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I'm fine, thanks.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 123 4567 and symbols #@! ok. Paris is the capital of France.",
    "Once upon a time, in a small village, there lived a curious child.",
]


def make_tokenizer(pre_tokenizer=None, tokenizer_class=None, extra_specials=()):
    """``tokenizer_class``: the transformers class to wrap it in (PreTrainedTokenizerFast by default), for
    converters that read the class name (llama.cpp takes Phi-4's BPE vocab only from a GPT2Tokenizer).
    ``extra_specials``: special tokens a converter looks up by name (GLM-4's ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)])
    return (tokenizer_class or PreTrainedTokenizerFast)(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra_specials], chat_template=CHAT_TEMPLATE,
    )


def split_then_bytes(regex: str):
    """A pre-tokenizer as Llama 3's and Qwen's tokenizer.json have it: a regex split, then bytes."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def family_tokenizer(arch: str):
    """The tiny tokenizer with what llama.cpp's converter for `arch` reads from it (special tokens by name,
    Qwen 3.5's split rule, Gemma's SentencePiece-style vocab, Phi-4's tokenizer class)."""
    if arch == "gemma4_text":  # llama.cpp's Gemma 4 converter reads Gemma's SentencePiece-style BPE only
        return make_spm_tokenizer()
    if arch == "phi3":  # Phi-4 ships a GPT2Tokenizer; llama.cpp reads its BPE vocab only then
        from transformers import GPT2Tokenizer

        return make_tokenizer(tokenizer_class=GPT2Tokenizer)
    split = SPLIT_RULES.get(arch)
    return make_tokenizer(pre_tokenizer=split_then_bytes(split()) if split else None,
                          extra_specials=EXTRA_SPECIALS.get(arch, ()))


def make_spm_tokenizer(specials=(), named=None, eos="<eos>", chat_template=CHAT_TEMPLATE):
    """A SentencePiece-style BPE tokenizer (spaces as U+2581, unknown bytes as <0xNN> tokens, BOS added),
    as Gemma ships: the only kind llama.cpp's Gemma 4 converter reads. Ids as Gemma's: pad 0, eos 1, bos 2.
    ``specials``: more added tokens after those (a vision family's image markers), ``named``: the ones the
    processor finds by attribute ({"image_token": ...}), ``eos``: the end token (Gemma's <end_of_turn>)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", "<bos>", "<unk>"]
    specials = base + [s for s in specials if s not in base]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")  # llama.cpp splits at newlines
    learner.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=COMMON["vocab_size"] - 256,
                                                                 special_tokens=specials))
    learnt = json.loads(learner.to_str())["model"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(learnt["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    if len(specials) > len(base):
        tok.add_special_tokens(specials[len(base):])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos, pad_token="<pad>",
                                        unk_token="<unk>", extra_special_tokens=named or None, chat_template=chat_template)
    unnamed = [s for s in specials[len(base):] if s not in (named or {}).values() and s != eos]
    if unnamed:  # special to the converter too (it marks only the tokenizer's special tokens as control tokens)
        tokenizer.add_special_tokens({"extra_special_tokens": unnamed}, replace_extra_special_tokens=False)
    return tokenizer


def make_model(arch: str, seed: int = 0, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{**COMMON, **PER_ARCH.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        norm = model.model.norm.weight
        stores_w_minus_1 = gemma and arch != "gemma4_text"  # Gemma 4's norms multiply by w itself
        norm.copy_((norm + 1) * 8 - 1 if stores_w_minus_1 else norm * 8)
        if gemma:
            model.get_input_embeddings().weight.mul_(0.1)
        for param in model.parameters():
            param.copy_(param.half().float())
    return model


def fake_tree(root, *, table=(), registered=()):
    """A llama.cpp tree whose converter knows ``table`` (conversion package) and ``registered`` (script)."""
    (root / "gguf-py").mkdir(parents=True)
    (root / "conversion").mkdir()
    lines = "\n".join(f"@ModelBase.register({name!r})\nclass M{i}: pass" for i, name in enumerate(registered))
    (root / "convert_hf_to_gguf.py").write_text(lines + "\n")
    entries = "".join(f"    {name!r}: 'llama',\n" for name in table)
    (root / "conversion" / "__init__.py").write_text(f"TEXT_MODEL_MAP: dict[str, str] = {{\n{entries}}}\n")
    return root


GREEDY_PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time")
GREEDY_TOKENS = 12


def greedy_agreement(model, llm, tokenizer, prompts=GREEDY_PROMPTS, n_tokens=GREEDY_TOKENS):
    """llama.cpp (`llm`) against transformers (`model`), free-running greedy from each prompt: the steps
    on which they agree before their first divergence (after one, the texts differ), the steps run,
    the tokens transformers chose, and each prompt's ids with llama.cpp's tokens."""
    from unsloth.export import runtime
    from unsloth.export.validate import reference_greedy

    agree, total, seen, runs = 0, 0, set(), []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        expected, _ = reference_greedy(model, ids, n_tokens)
        got = runtime.greedy(llm, ids, n_tokens)
        agree += next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), n_tokens)
        total += n_tokens
        seen.update(expected)
        runs.append((ids, got))
    return agree, total, seen, runs
