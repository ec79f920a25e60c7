"""Chat-template helpers that fine-tuning notebooks import (`from unsloth.chat_templates import ...`).

    tokenizer = get_chat_template(tokenizer, "llama-3.1")
    dataset = standardize_sharegpt(dataset)           # {"from", "value"} turns -> {"role", "content"}
    trainer = train_on_responses_only(trainer, instruction_part="<|start_header_id|>user<|end_header_id|>\\n\\n",
                                      response_part="<|start_header_id|>assistant<|end_header_id|>\\n\\n")
"""

from __future__ import annotations

# The templates are the formats these model families were trained with (as their tokenizers ship them).
_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
TEMPLATES = {
    "chatml": _CHATML, "qwen-2.5": _CHATML, "qwen2.5": _CHATML, "qwen-3": _CHATML, "qwen3": _CHATML,
    "llama-3": _LLAMA3, "llama3": _LLAMA3, "llama-3.1": _LLAMA3, "llama-31": _LLAMA3, "llama-3.2": _LLAMA3,
    "gemma": _GEMMA, "gemma-2": _GEMMA, "gemma2": _GEMMA, "gemma-3": _GEMMA, "gemma3": _GEMMA,
    "mistral": _MISTRAL,
}


def get_chat_template(tokenizer, chat_template: str = "chatml", mapping: dict | None = None, **_unused):
    """Set the tokenizer's chat template by name (or a Jinja string); returns the tokenizer."""
    if chat_template in TEMPLATES:
        tokenizer.chat_template = TEMPLATES[chat_template]
    elif "{%" in chat_template or "{{" in chat_template:
        tokenizer.chat_template = chat_template
    else:
        raise ValueError(f"unknown chat template {chat_template!r}; known: {', '.join(sorted(TEMPLATES))}, "
                         "or pass a Jinja template string")
    if mapping:  # e.g. {"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
        tokenizer.chat_template = _remap(tokenizer.chat_template, mapping)
    return tokenizer


def _remap(template: str, mapping: dict) -> str:
    role, content = mapping.get("role", "role"), mapping.get("content", "content")
    template = template.replace("message['role']", f"message['{role}']").replace(
        "message['content']", f"message['{content}']")
    for ours in ("user", "assistant", "system"):
        theirs = mapping.get(ours)
        if theirs and theirs != ours:
            template = template.replace(f"== '{ours}'", f"== '{theirs}'")
    return template


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "model": "assistant"}


def standardize_sharegpt(dataset, aliases_for_system=("system",), aliases_for_user=("human", "user"),
                         aliases_for_assistant=("gpt", "assistant", "model")):
    """ShareGPT turns ({"from", "value"}) as {"role", "content"}, in the same column, other columns kept.

    The column keeps its name ("conversations" stays "conversations") because notebooks go on to read
    `examples["conversations"]`, as they do with the original Unsloth helper.
    """
    roles = dict(_SHAREGPT_ROLES)
    roles.update({a: "system" for a in aliases_for_system})
    roles.update({a: "user" for a in aliases_for_user})
    roles.update({a: "assistant" for a in aliases_for_assistant})
    column = "conversations" if "conversations" in dataset.column_names else "messages"

    def convert(row):
        turns = row[column]
        return {column: [{"role": roles.get(t.get("from", t.get("role")), t.get("from", t.get("role"))),
                          "content": t.get("value", t.get("content"))} for t in turns]}

    return dataset.map(convert)


def _find(sequence: list[int], part: list[int], start: int) -> int:
    n = len(part)
    for i in range(start, len(sequence) - n + 1):
        if sequence[i:i + n] == part:
            return i
    return -1


def response_only_labels(input_ids: list[int], instruction: list[int], response: list[int]) -> list[int]:
    """Labels that keep only the tokens after each response marker, up to the next instruction marker."""
    labels = [-100] * len(input_ids)
    at = _find(input_ids, response, 0)
    while at >= 0:
        begin = at + len(response)
        end = _find(input_ids, instruction, begin)
        stop = len(input_ids) if end < 0 else end
        labels[begin:stop] = input_ids[begin:stop]
        at = _find(input_ids, response, stop)
    return labels


def train_on_responses_only(trainer, instruction_part: str, response_part: str, **_unused):
    """Make the trainer's loss count only the assistant's replies (markers as they appear in the template)."""
    import torch

    tokenizer = trainer.processing_class
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    instruction = tokenizer(instruction_part, add_special_tokens=False)["input_ids"]
    response = tokenizer(response_part, add_special_tokens=False)["input_ids"]
    collate = trainer.data_collator

    def collate_responses_only(examples):
        batch = collate(examples)
        labels = [response_only_labels(row.tolist(), instruction, response) for row in batch["input_ids"]]
        masked = torch.tensor(labels, dtype=batch["labels"].dtype, device=batch["labels"].device)
        batch["labels"] = torch.where(batch["labels"] == -100, batch["labels"], masked)  # keep padding masked
        return batch

    trainer.data_collator = collate_responses_only
    return trainer
