"""Chat-template and dataset helpers that fine-tuning notebooks import (`from unsloth.chat_templates import ...`).

    tokenizer = get_chat_template(tokenizer, "llama-3.1")          # or chatml, qwen3, gemma-3, mistral, ...
    dataset = standardize_sharegpt(dataset)                         # {"from", "value"} -> {"role", "content"}
    trainer = train_on_responses_only(trainer)                      # markers inferred from the template

The templates render what the model families' own tokenizers render (same text, so the same tokens).
"""

from __future__ import annotations

import json
import random
import re

# --- the templates -------------------------------------------------------------------------------
# Jinja, written for these families' formats; `content` may be a string or a list of typed parts.

_TEXT = ("{%- macro text(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
         "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
         "{%- elif part['type'] == 'image' -%}<start_of_image>{%- endif -%}{%- endfor -%}{%- endif -%}"
         "{%- endmacro -%}")

_CHATML = (_TEXT + "{%- for message in messages -%}"
           "{{ '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}"
           "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")

_QWEN25 = (_TEXT + "{%- if messages[0]['role'] != 'system' -%}"
           "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
           "{%- endif -%}{%- for message in messages -%}"
           "{{ '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}"
           "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")


def _qwen3(generation: str, strip_thinking: bool) -> str:
    # Earlier assistant turns lose their reasoning (<think>...</think>), as Qwen3's own template does.
    assistant = ("{%- set c = text(message['content']) -%}"
                 "{%- if '</think>' in c and not loop.last -%}{%- set c = c.split('</think>')[-1].lstrip('\n') -%}"
                 "{%- endif -%}") if strip_thinking else "{%- set c = text(message['content']) -%}"
    return (_TEXT + "{%- for message in messages -%}"
            "{%- if message['role'] == 'assistant' -%}" + assistant +
            "{{ '<|im_start|>assistant\n' + c + '<|im_end|>\n' }}"
            "{%- else -%}{{ '<|im_start|>' + message['role'] + '\n' + text(message['content']) + '<|im_end|>\n' }}"
            "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}" + generation + "{%- endif -%}")


_QWEN3 = _qwen3("{{ '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false -%}"
                "{{ '<think>\n\n</think>\n\n' }}{%- endif -%}", strip_thinking=True)
_QWEN3_INSTRUCT = _qwen3("{{ '<|im_start|>assistant\n' }}", strip_thinking=False)
_QWEN3_THINKING = _qwen3("{{ '<|im_start|>assistant\n<think>\n' }}", strip_thinking=True)

_LLAMA3 = (_TEXT + "{{ bos_token }}{%- for message in messages -%}"
           "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + text(message['content']) | trim"
           " + '<|eot_id|>' }}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}")

# Llama 3.1 / 3.2 always open with a system header carrying the knowledge cut-off and a date.
_LLAMA31 = (_TEXT + "{{ bos_token }}{%- if date_string is not defined -%}{%- set date_string = '26 Jul 2024' -%}"
            "{%- endif -%}{%- if messages[0]['role'] == 'system' -%}"
            "{%- set system_message = text(messages[0]['content']) | trim -%}{%- set messages = messages[1:] -%}"
            "{%- else -%}{%- set system_message = '' -%}{%- endif -%}"
            "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: ' + date_string + '\n\n' + system_message + '<|eot_id|>' }}"
            "{%- for message in messages -%}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + text(message['content']) | trim"
            " + '<|eot_id|>' }}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}")

# Gemma: no system role; a system message is prepended to the first user turn.
_GEMMA3 = (_TEXT + "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
           "{%- set first_user_prefix = text(messages[0]['content']) + '\n\n' -%}{%- set messages = messages[1:] -%}"
           "{%- else -%}{%- set first_user_prefix = '' -%}{%- endif -%}"
           "{%- for message in messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
           "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
           " + text(message['content']) | trim + '<end_of_turn>\n' }}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")

# Gemma 4: its own turn markers, a system turn of its own, and images / audio as their placeholder tokens.
_GEMMA4 = ("{%- macro parts(content) -%}{%- if content is string -%}{{ content | trim }}{%- else -%}"
           "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}"
           "{%- elif part['type'] == 'image' -%}<|image|>{%- elif part['type'] == 'audio' -%}<|audio|>"
           "{%- elif part['type'] == 'video' -%}<|video|>{%- endif -%}{%- endfor -%}{%- endif -%}"
           "{%- endmacro -%}{{ bos_token }}{%- for message in messages -%}"
           "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
           "{{ '<|turn>' + role + '\n' }}{{ parts(message['content']) }}{{ '<turn|>\n' }}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}")

_MISTRAL = (_TEXT + "{{ bos_token }}{%- for message in messages -%}"
            "{%- if message['role'] == 'user' -%}{{ '[INST] ' + text(message['content']) + ' [/INST]' }}"
            "{%- elif message['role'] == 'assistant' -%}{{ text(message['content']) + eos_token }}"
            "{%- elif message['role'] == 'system' -%}{{ text(message['content']) + '\n\n' }}{%- endif -%}{%- endfor -%}")

_PHI4 = (_TEXT + "{%- for message in messages -%}"
         "{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + text(message['content']) + '<|im_end|>' }}"
         "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant<|im_sep|>' }}{%- endif -%}")

_ZEPHYR = (_TEXT + "{%- for message in messages -%}"
           "{{ '<|' + message['role'] + '|>\n' + text(message['content']) + eos_token + '\n' }}"
           "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}")

_ALPACA_SYSTEM = ("Below are some instructions that describe some tasks. Write responses that appropriately "
                  "complete each request.")
_ALPACA = (_TEXT + "{%- if messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) + '\n\n' }}"
           "{%- set messages = messages[1:] -%}{%- else -%}{{ '" + _ALPACA_SYSTEM + "\n\n' }}{%- endif -%}"
           "{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
           "{{ '### Instruction:\n' + text(message['content']) + '\n\n' }}"
           "{%- elif message['role'] == 'assistant' -%}{{ '### Response:\n' + text(message['content']) + eos_token"
           " + '\n\n' }}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '### Response:\n' }}{%- endif -%}")

_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                  "helpful, detailed, and polite answers to the user's questions.")
_VICUNA = (_TEXT + "{%- if messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) + ' ' }}"
           "{%- set messages = messages[1:] -%}{%- else -%}{{ '" + _VICUNA_SYSTEM.replace("'", "\\'") + " ' }}"
           "{%- endif -%}{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
           "{{ 'USER: ' + text(message['content']) + ' ' }}{%- elif message['role'] == 'assistant' -%}"
           "{{ 'ASSISTANT: ' + text(message['content']) + eos_token }}{%- endif -%}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}")

TEMPLATES = {
    "chatml": _CHATML, "qwen-2.5": _QWEN25, "qwen2.5": _QWEN25, "qwen-25": _QWEN25, "qwen25": _QWEN25,
    "qwen-3": _QWEN3, "qwen3": _QWEN3, "qwen3-instruct": _QWEN3_INSTRUCT, "qwen3-thinking": _QWEN3_THINKING,
    "llama-3": _LLAMA3, "llama3": _LLAMA3,
    "llama-3.1": _LLAMA31, "llama-31": _LLAMA31, "llama-3.2": _LLAMA31, "llama-32": _LLAMA31,
    "llama-3.3": _LLAMA31, "llama-33": _LLAMA31,
    "gemma-3": _GEMMA3, "gemma3": _GEMMA3, "gemma3n": _GEMMA3, "gemma-3n": _GEMMA3,
    "gemma": _GEMMA3, "gemma-2": _GEMMA3, "gemma2": _GEMMA3, "gemma-4": _GEMMA4, "gemma4": _GEMMA4,
    "mistral": _MISTRAL, "phi-4": _PHI4, "phi4": _PHI4, "zephyr": _ZEPHYR, "alpaca": _ALPACA, "vicuna": _VICUNA,
}
# The text each template ends a turn with (what generation must stop at).
END_OF_TURN = {_CHATML: "<|im_end|>", _QWEN25: "<|im_end|>", _QWEN3: "<|im_end|>", _QWEN3_INSTRUCT: "<|im_end|>",
               _QWEN3_THINKING: "<|im_end|>", _LLAMA3: "<|eot_id|>", _LLAMA31: "<|eot_id|>",
               _GEMMA3: "<end_of_turn>", _GEMMA4: "<turn|>", _PHI4: "<|im_end|>"}


def get_chat_template(tokenizer, chat_template="chatml", mapping: dict | None = None,
                      map_eos_token: bool = True, system_message: str | None = None):
    """Set the tokenizer's chat template by name, Jinja string or (template, end-of-turn) pair; returns it.

    `mapping`: dataset keys and role names, e.g. ShareGPT's {"role": "from", "content": "value",
    "user": "human", "assistant": "gpt"}. `map_eos_token`: make the template's end-of-turn marker the
    token generation stops at: the tokenizer's EOS becomes the marker when the vocabulary has it as one
    token, else the template writes EOS in its place. A processor (vision-language models) gets the
    template on itself and on its tokenizer, and its tokenizer's EOS is the one mapped.
    """
    processor, tokenizer = tokenizer, getattr(tokenizer, "tokenizer", tokenizer)
    end, named = None, False
    if isinstance(chat_template, (tuple, list)):
        template, end = chat_template
        end = None if end == "eos_token" else end  # Unsloth's spelling of "the tokenizer's own EOS"
    elif chat_template in TEMPLATES:
        template, named = TEMPLATES[chat_template], True
        end = END_OF_TURN.get(template)
    elif "{%" in chat_template or "{{" in chat_template:
        template = chat_template
    else:
        raise ValueError(f"unknown chat template {chat_template!r}; known: {', '.join(sorted(TEMPLATES))}, "
                         "a Jinja template string, or a (template, end-of-turn token) pair")
    if mapping:
        template = _remap(template, mapping)
    if system_message is not None:
        template = "{%- if messages[0]['role'] != 'system' -%}{%- set messages = [{'role': 'system', " \
                   f"'content': {json.dumps(system_message)}}}] + messages -%}}{{%- endif -%}}" + template
    if map_eos_token and end:
        if _single_token(tokenizer, end):
            if tokenizer.eos_token != end:
                tokenizer.eos_token = end  # generation stops at the end of the turn
        elif tokenizer.eos_token and named:
            template = template.replace(end, "' + eos_token + '")  # the marker is text here: end turns with EOS
    tokenizer.chat_template = template
    processor.chat_template = template
    return processor


def _single_token(tokenizer, text: str) -> bool:
    vocab = tokenizer.get_vocab()
    return text in vocab


def _remap(template: str, mapping: dict) -> str:
    role, content = mapping.get("role", "role"), mapping.get("content", "content")
    template = template.replace("message['role']", f"_r(message['{role}'])") \
                       .replace("messages[0]['role']", f"_r(messages[0]['{role}'])") \
                       .replace("['content']", f"['{content}']")
    names = {theirs: ours for ours, theirs in mapping.items() if ours in ("user", "assistant", "system")}
    table = json.dumps(names)
    return ("{%- set _roles = " + table + " -%}{%- macro _r(name) -%}{{ _roles.get(name, name) }}{%- endmacro -%}"
            + template)


# --- datasets ------------------------------------------------------------------------------------

_ROLE_KEYS = ("role", "from", "speaker", "author")
_CONTENT_KEYS = ("content", "value", "text", "message")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
          "model": "assistant", "chatgpt": "assistant", "system": "system"}


def _conversation_column(dataset) -> str:
    for name in ("conversations", "messages", "conversation", "dialog", "chat"):
        if name in dataset.column_names:
            return name
    first = dataset[0]
    for name, value in first.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return name
    raise ValueError(f"no conversation column (a list of turns) among {dataset.column_names}")


def standardize_sharegpt(dataset, aliases_for_system=("system",), aliases_for_user=("human", "user"),
                         aliases_for_assistant=("gpt", "assistant", "model"), num_proc=None):
    """Turns as {"role", "content"} with user / assistant / system roles, in the same column.

    The column keeps its name ("conversations" stays "conversations") because notebooks go on to read
    `examples["conversations"]`, as they do with the original Unsloth helper.
    """
    roles = dict(_ROLES)
    roles.update({a: "system" for a in aliases_for_system})
    roles.update({a: "user" for a in aliases_for_user})
    roles.update({a: "assistant" for a in aliases_for_assistant})
    column = _conversation_column(dataset)
    turns = dataset[0][column]
    role_key = next((k for k in _ROLE_KEYS if k in turns[0]), None)
    content_key = next((k for k in _CONTENT_KEYS if k in turns[0]), None)
    if role_key is None or content_key is None:
        raise ValueError(f"{column}: turns have keys {sorted(turns[0])}; expected a role key ({', '.join(_ROLE_KEYS)}) "
                         f"and a content key ({', '.join(_CONTENT_KEYS)})")

    def convert(row):
        return {column: [{"role": roles.get(t[role_key], t[role_key]), "content": t[content_key]}
                         for t in row[column]]}

    return dataset.map(convert, num_proc=num_proc)


def standardize_data_formats(dataset, tokenizer=None, aliases_for_system=("system",),
                             aliases_for_user=("human", "user"), aliases_for_assistant=("gpt", "assistant", "model"),
                             num_proc=None):
    """Any of the common chat layouts (ShareGPT from/value, role/content, other key names) as role/content turns."""
    return standardize_sharegpt(dataset, aliases_for_system, aliases_for_user, aliases_for_assistant, num_proc)


_FIELD = re.compile(r"\{(\w+)\}")
_OPTIONAL = re.compile(r"\[\[(.*?)\]\]", re.S)


def _fill(template: str, row: dict) -> str:
    """`{column}` filled in; a `[[...]]` section only when every column it names is non-empty."""
    def optional(match):
        part = match.group(1)
        return _FIELD.sub(lambda m: str(row[m.group(1)]), part) if all(
            str(row.get(name) or "").strip() for name in _FIELD.findall(part)) else ""

    return _FIELD.sub(lambda m: str(row[m.group(1)]), _OPTIONAL.sub(optional, template))


def to_sharegpt(dataset, merged_prompt: str = "", merged_column_name: str = "instruction",
                output_column_name: str = "output", remove_unused_columns: bool = True,
                conversation_extension: int = 1, random_state: int = 3407):
    """Columns merged into one prompt (`{col}`, optional `[[...]]` parts) + the output, as ShareGPT turns.

    `conversation_extension` > 1 joins that many rows (shuffled with `random_state`) into one multi-turn
    conversation. The result has a "conversations" column of {"from": "human"|"gpt", "value"} turns.
    """
    missing = [c for c in _FIELD.findall(merged_prompt) + [output_column_name] if c not in dataset.column_names]
    if missing:
        raise ValueError(f"to_sharegpt: no column {missing[0]!r}; columns are {', '.join(dataset.column_names)}")

    def convert(row):
        prompt = _fill(merged_prompt, row) if merged_prompt else str(row[merged_column_name])
        return {"conversations": [{"from": "human", "value": prompt},
                                  {"from": "gpt", "value": str(row[output_column_name])}]}

    columns = dataset.column_names if remove_unused_columns else None
    data = dataset.map(convert, remove_columns=columns)
    if conversation_extension > 1:
        from datasets import Dataset

        order = list(range(len(data)))
        random.Random(random_state).shuffle(order)
        rows = data["conversations"]
        joined = [sum((rows[order[(i + k) % len(order)]] for k in range(conversation_extension)), [])
                  for i in range(len(order))]
        data = Dataset.from_dict({"conversations": joined})
    return data


def apply_chat_template(dataset, tokenizer=None, chat_template: str | None = None,
                        default_system_message: str | None = None, num_proc=None):
    """A "text" column from the conversations, through `chat_template` written with {SYSTEM}, {INPUT}, {OUTPUT}
    (the Ollama-style form the notebooks use), which also becomes the tokenizer's chat template."""
    if chat_template is not None:
        tokenizer.chat_template = template_from_placeholders(chat_template, default_system_message,
                                                             tokenizer.eos_token or "")
    column = _conversation_column(dataset)
    if dataset[0][column] and "from" in dataset[0][column][0]:
        dataset = standardize_sharegpt(dataset)

    def render(rows):
        return {"text": [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                         for c in rows[column]]}

    return dataset.map(render, batched=True, num_proc=num_proc)


def template_from_placeholders(template: str, default_system: str | None, eos_token: str) -> str:
    """Jinja for a prompt written as text with {SYSTEM}, {INPUT} and {OUTPUT} (one user/assistant exchange)."""
    if "{INPUT}" not in template or "{OUTPUT}" not in template:
        raise ValueError("the chat template must contain {INPUT} and {OUTPUT} (and may contain {SYSTEM})")
    before, rest = template.split("{INPUT}", 1)
    between, after = rest.split("{OUTPUT}", 1)
    system_part, turn_prefix = before.split("{SYSTEM}", 1) if "{SYSTEM}" in before else ("", before)
    lit = json.dumps
    system = "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else " \
             f"{lit(default_system or '')} -%}}"
    head = "" if "{SYSTEM}" not in before else "{{ " + lit(system_part) + " + system }}"
    return (system + head + "{%- for message in messages -%}"
            "{%- if message['role'] == 'user' -%}{{ " + lit(turn_prefix) + " + message['content'] + "
            + lit(between) + " }}{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token + "
            + lit(after) + " }}{%- endif -%}{%- endfor -%}")


# --- response-only training ----------------------------------------------------------------------

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


def response_markers(tokenizer) -> tuple[str, str]:
    """(instruction_part, response_part) read off the tokenizer's chat template: the text that opens a
    user turn and an assistant turn (each without the previous turn's end marker)."""
    user, reply = "\u2063USER\u2063", "\u2063REPLY\u2063"
    render = lambda m, g=False: tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=g)  # noqa: E731
    u = {"role": "user", "content": user}
    a = {"role": "assistant", "content": reply}
    two = render([u, a, u, a])
    try:
        first_user_end = render([u]).split(user, 1)[1]
        first_reply_end = render([u, a]).split(reply, 1)[1]
    except IndexError:
        raise ValueError("train_on_responses_only: the chat template did not render test messages; pass "
                         "instruction_part and response_part") from None
    # Between the first reply and the second user message: the reply's end marker, then the user opener.
    between = two.split(reply, 1)[1].split(user, 1)[0]
    instruction = between[len(first_reply_end):] if between.startswith(first_reply_end) else between
    response = two.split(user, 1)[1].split(reply, 1)[0]
    response = response[len(first_user_end):] if response.startswith(first_user_end) and \
        len(response) > len(first_user_end) else response
    if not instruction.strip() or not response.strip():
        raise ValueError("train_on_responses_only: could not find the user and assistant markers in the chat "
                         "template; pass instruction_part and response_part")
    return instruction, response


def train_on_responses_only(trainer, instruction_part: str | None = None, response_part: str | None = None,
                            force_match: bool = True, tokenizer=None, return_function: bool = False,
                            num_proc=None):
    """Count only the assistant's replies in the loss: the trainer's datasets get masked `labels` (visible
    in `trainer.train_dataset`, as in Unsloth), and the collator keeps them. Markers default to the ones
    the tokenizer's chat template writes."""
    tokenizer = tokenizer or trainer.processing_class
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if instruction_part is None or response_part is None:
        inferred = response_markers(tokenizer)
        instruction_part = inferred[0] if instruction_part is None else instruction_part
        response_part = inferred[1] if response_part is None else response_part
    instruction = tokenizer(instruction_part, add_special_tokens=False)["input_ids"]
    response = tokenizer(response_part, add_special_tokens=False)["input_ids"]

    def mask(rows):
        out = []
        for ids, old in zip(rows["input_ids"], rows.get("labels") or rows["input_ids"]):
            new = response_only_labels(list(ids), instruction, response)
            out.append([n if o != -100 else -100 for n, o in zip(new, old)])  # keep what was masked already
        return {"labels": out}

    if return_function:
        return mask
    trainer.train_dataset = trainer.train_dataset.map(mask, batched=True, num_proc=num_proc)
    if getattr(trainer, "eval_dataset", None) is not None and not isinstance(trainer.eval_dataset, dict):
        trainer.eval_dataset = trainer.eval_dataset.map(mask, batched=True, num_proc=num_proc)
    if force_match and len(trainer.train_dataset) and all(x == -100 for x in trainer.train_dataset[0]["labels"]):
        raise ValueError(f"train_on_responses_only: the response marker {response_part!r} does not occur in the "
                         "first example, so it would train on nothing; check instruction_part / response_part "
                         "against tokenizer.decode(trainer.train_dataset[0]['input_ids'])")
    return trainer
