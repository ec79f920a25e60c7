"""An Ollama Modelfile for an exported GGUF, its prompt format derived from the chat template.

Ollama speaks Go templates, not Jinja. Rather than translating Jinja, the model's own template is
rendered with marker contents for one message of each role; what surrounds a marker is that role's
prefix and suffix, and the Go template replays them. Exact for the usual "role header + content +
end marker" templates; a template that cannot be rendered this way leaves TEMPLATE out, and Ollama
then uses the chat template stored in the GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MARK = "\u2063{}\u2063"  # invisible separator around a role's marker content


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _affixes(tokenizer: Any, history: list[dict[str, str]], role: str) -> tuple[str, str] | None:
    """The text the template puts before and after a ``role`` message that follows ``history``."""
    marker = _MARK.format(role)
    before = _render(tokenizer, history) if history else ""
    text = _render(tokenizer, history + [{"role": role, "content": marker}])
    if not text.startswith(before) or marker not in text:
        return None
    prefix, suffix = text[len(before) :].split(marker, 1)
    return prefix, suffix


def role_affixes(tokenizer: Any) -> tuple[dict[str, tuple[str, str]], str] | None:
    """{role: (prefix, suffix)} and the generation prompt, or None if the template resists."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    user = {"role": "user", "content": "anchor"}
    turn = [user, {"role": "assistant", "content": "anchor"}]
    try:
        generation = _render(tokenizer, [user], generation_prompt=True)[len(_render(tokenizer, [user])) :]
        # User and assistant affixes come from later turns, free of start-of-sequence text.
        affixes = {"user": _affixes(tokenizer, turn, "user"), "assistant": _affixes(tokenizer, [user], "assistant")}
        first_user = _affixes(tokenizer, [], "user")
    except Exception:  # templates may raise on role orders they do not accept
        return None
    if affixes["user"] is None or affixes["assistant"] is None:
        return None
    try:
        system = _affixes(tokenizer, [], "system")  # a first message: may carry the BOS text
    except Exception:  # a template without a system role
        system = None
    bos = tokenizer.bos_token or ""
    # BOS written once by the template at the very start: llama.cpp adds it itself, so drop it.
    sequence_bos = bos if first_user and first_user[0] == bos + affixes["user"][0] else ""
    if system is not None:
        affixes["system"] = (system[0].removeprefix(sequence_bos), system[1])
    return affixes, generation


def _go_literal(text: str) -> str:
    return text.replace("{{", '{{ "{{" }}')


def render_modelfile(gguf_name: str, tokenizer: Any) -> str:
    lines = [f"FROM ./{gguf_name}", ""]
    derived = role_affixes(tokenizer)
    stops = []
    if derived is not None:
        affixes, generation = derived
        branches = []
        for role, (prefix, suffix) in affixes.items():
            branches.append(f'if eq .Role "{role}" }}}}{_go_literal(prefix)}{{{{ .Content }}}}{_go_literal(suffix)}')
            if suffix.strip():
                stops.append(suffix.strip())
        body = "{{- range .Messages }}{{ " + "{{ else ".join(branches) + "{{ end }}{{ end }}" + _go_literal(generation)
        lines += [f'TEMPLATE """{body}"""', ""]
    if tokenizer.eos_token:
        stops.append(tokenizer.eos_token)
    for stop in dict.fromkeys(stops):
        lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"


def write_modelfile(directory: Path, gguf_path: Path, tokenizer: Any) -> Path:
    path = directory / "Modelfile"
    path.write_text(render_modelfile(gguf_path.name, tokenizer), encoding="utf-8")
    return path
