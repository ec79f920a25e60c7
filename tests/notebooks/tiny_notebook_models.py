"""Tiny random models of the notebook families, saved as local folders with a tokenizer that has the
family's special tokens (byte-level BPE, so the GGUF export reads it), and datasets with the columns
the notebooks' datasets have (Alpaca, ShareGPT "conversations", GSM8K-style prompts)."""

from __future__ import annotations

from pathlib import Path

# family -> (bos, eos, pad, chat specials, whether encoding adds BOS)
SPECIALS = {
    "llama": ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
              ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], True),
    "qwen2": (None, "<|endoftext|>", "<|endoftext|>", ["<|im_start|>", "<|im_end|>"], False),
    "qwen3": (None, "<|endoftext|>", "<|endoftext|>", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], False),
    "gemma3_text": ("<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>"], True),
    "mistral": ("<s>", "</s>", "<unk>", ["[INST]", "[/INST]"], True),
    "lfm2": ("<|startoftext|>", "<|im_end|>", "<|pad|>", ["<|im_start|>"], True),
    "falcon_h1": ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", ["<|im_start|>", "<|im_end|>"], False),
    "granitemoehybrid": (None, "<|end_of_text|>", "<|pad|>", ["<|start_of_role|>", "<|end_of_role|>"], False),
    "ernie4_5_moe": ("<s>", "</s>", "<unk>", ["<|begin_of_sentence|>", "<|end_of_sentence|>"], False),
    "nemotron_h": ("<s>", "<|im_end|>", "<unk>", ["<|im_start|>", "<think>", "</think>"], False),
    "functiongemma": ("<bos>", "<eos>", "<pad>", ["<start_of_turn>", "<end_of_turn>", "<start_function_declaration>",
                      "<end_function_declaration>", "<start_function_call>", "<end_function_call>",
                      "<start_function_response>", "<end_function_response>"], True),
}
SPECIALS["granitemoehybrid_mamba"] = SPECIALS["granitemoehybrid"]
SPECIALS["gemma3_text_tools"] = SPECIALS["functiongemma"]
# The turn layout of each family's released chat template (written here from their rendered output, in
# short): what the notebooks' formatting and train_on_responses_only (markers read off it) see.
_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_TEMPLATES = {
    "lfm2": "{{ bos_token }}" + _CHATML,
    "nemotron_h": _CHATML,
    "granitemoehybrid": (
        "{% for m in messages %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + "
        "'<|end_of_text|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"),
    "ernie4_5_moe": (
        "<|begin_of_sentence|>{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + '<|end_of_sentence|>' }}"
        "{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"),
    # FunctionGemma: the system turn is the developer's, with the tools' declarations; tool calls and
    # their results go inside the model's turn
    "gemma3_text_tools": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' or tools %}<start_of_turn>developer\n"
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
        "{% for t in tools or [] %}<start_function_declaration>declaration:{{ t['function']['name'] }}"
        "{{ t['function']['parameters'] | tojson }}<end_function_declaration>{% endfor %}<end_of_turn>\n{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}<start_of_turn>user\n{{ m['content'] }}<end_of_turn>\n"
        "{% elif m['role'] == 'assistant' %}<start_of_turn>model\n{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<start_function_call>call:{{ c['function']['name'] }}"
        "{{ c['function']['arguments'] | tojson }}<end_function_call>{% endfor %}"
        "{% if not m.get('tool_calls') %}<end_of_turn>\n{% endif %}"
        "{% elif m['role'] == 'tool' %}<start_function_response>response:{{ m['name'] }}{{ m['content'] }}"
        "<end_function_response>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
CHAT_TEMPLATES["granitemoehybrid_mamba"] = CHAT_TEMPLATES["granitemoehybrid"]
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nName the capital of France.\n\n### Input:\n\n### Response:\nParis is the capital.",
    "Continue the fibonacci sequence: 1, 1, 2, 3, 5, 8, 13, 21, 34, 55 and 89.",
    "user assistant system model human gpt The quick brown fox jumps over the lazy dog.",
    "What is 2 + 2? <reasoning>two and two</reasoning><answer>4</answer> Think step by step.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are Qwen, created by Alibaba Cloud.",
]
QA = [("Name the capital of France.", "Paris."), ("What is 2 + 2?", "4."), ("Name a color.", "Blue."),
      ("Continue 1, 1, 2, 3, 5", "8, 13, 21."), ("Say hello.", "Hello!"), ("Name a fruit.", "An apple."),
      ("What is 3 + 4?", "7."), ("Name the capital of Peru.", "Lima.")]


def make_tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad, chat, adds_bos = SPECIALS[family]
    specials = [t for t in dict.fromkeys([bos, eos, pad, *chat]) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                        additional_special_tokens=[t for t in chat])
    tokenizer.chat_template = CHAT_TEMPLATES.get(family)
    return tokenizer


def make_sentencepiece_tokenizer(family: str, directory: Path):
    """A SentencePiece tokenizer as Gemma 3 and Mistral v0.3 ship one: a byte-fallback BPE tokenizer.model
    (the family's specials in its id order, its chat markers as pieces) in `directory`, loaded by
    transformers from that file."""
    import sentencepiece as spm
    import transformers

    bos, eos, pad, chat, adds_bos = SPECIALS[family]
    gemma = family.startswith("gemma")
    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece=pad, eos_piece=eos, bos_piece=bos) if gemma
           else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, bos_piece=bos, eos_piece=eos))
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 10), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, add_dummy_prefix=family == "mistral",
        normalization_rule_name="identity", remove_extra_whitespaces=False, user_defined_symbols=chat,
        minloglevel=2, **ids)
    corpus.unlink()
    (directory / "tokenizer.vocab").unlink()
    tokenizer_class = transformers.GemmaTokenizer if gemma else transformers.LlamaTokenizer
    # ERNIE 4.5's tokenizer adds neither a BOS nor a leading space ("User:" encodes as in its template)
    spacing = {} if gemma or family == "mistral" else {"add_prefix_space": False}
    tokenizer = tokenizer_class.from_pretrained(directory, add_bos_token=adds_bos, **spacing)
    tokenizer.chat_template = CHAT_TEMPLATES.get(family)
    return tokenizer


def write_model(directory: Path, family: str, dtype="float32", sentencepiece: bool = False, tokenizer_family=None,
                **config_overrides) -> str:
    """A tiny random model of `family` and its tokenizer in `directory` (a local "hub id" for from_pretrained);
    `sentencepiece`: the tokenizer is a SentencePiece one with its tokenizer.model, as on the hub;
    `tokenizer_family`: the SPECIALS / CHAT_TEMPLATES entry, where it is not `family`'s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from tiny_families import family_config

    tokenizer_family = tokenizer_family or family
    tokenizer = (make_sentencepiece_tokenizer(tokenizer_family, directory) if sentencepiece
                 else make_tokenizer(tokenizer_family))
    config = family_config(family)
    text_config = getattr(config, "text_config", config)  # a vision-language model's language model
    for key, value in config_overrides.items():
        setattr(config, key, value)
    text_config.vocab_size = len(tokenizer)
    text_config.bos_token_id = tokenizer.bos_token_id
    text_config.eos_token_id = tokenizer.eos_token_id
    text_config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    causal = type(config) in AutoModelForCausalLM._model_mapping
    model = (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # spread logits: greedy tokens are not coin tosses
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def alpaca_rows(n: int = 16):
    return [{"instruction": q, "input": "" if i % 2 else "Answer briefly.", "output": a}
            for i, (q, a) in enumerate((QA * 4)[:n])]


def sharegpt_rows(n: int = 16):
    return [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}], "source": "tiny",
             "score": 1.0} for q, a in (QA * 4)[:n]]


def transformers_major() -> int:
    """The major version of the transformers in use (scripts/test runs the notebooks on 4 and on 5)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).major


def losses_of(trainer) -> list[float]:
    """The training losses a trainer logged, in order."""
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]
