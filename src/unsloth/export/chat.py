"""Talking to a GGUF through llama.cpp: one-shot generation and streamed chat turns, with the
chat template stored in the file (llama-cpp-python renders it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from unsloth.export import runtime


@dataclass
class Generation:
    model: str
    prompt: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens_per_second"] = round(self.completion_tokens / self.seconds, 2) if self.seconds else None
        return data


def has_chat_template(llm: Any) -> bool:
    return bool(llm.metadata.get("tokenizer.chat_template"))


def messages_for(prompt: str, system: str | None = None, image: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of one prompt; `image` (a file) goes before the prompt in the user's turn."""
    content: Any = prompt
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": runtime.image_url(image)}}, {"type": "text", "text": prompt}]
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def stream(llm: Any, prompt: str, *, raw: bool, system: str | None = None, image: str | None = None,
           **sampling: Any) -> Iterator[dict[str, Any]]:
    """Chunks as llama-cpp-python yields them: the chat template applied unless ``raw`` (or absent)."""
    if raw or not has_chat_template(llm):
        for chunk in llm.create_completion(prompt, stream=True, **sampling):
            yield {"text": chunk["choices"][0]["text"], "finish_reason": chunk["choices"][0]["finish_reason"]}
    else:
        yield from chat_stream(llm, messages_for(prompt, system, image), **sampling)


def chat_stream(llm: Any, messages: list[dict[str, str]], **sampling: Any) -> Iterator[dict[str, Any]]:
    for chunk in llm.create_chat_completion(messages, stream=True, **sampling):
        choice = chunk["choices"][0]
        yield {"text": choice["delta"].get("content", ""), "finish_reason": choice["finish_reason"]}


def generate(llm: Any, model: str, prompt: str, *, raw: bool, system: str | None = None, image: str | None = None,
             **sampling: Any) -> Generation:
    """Run one prompt to the end, without streaming, so the token counts come back too."""
    start = time.perf_counter()
    if raw or not has_chat_template(llm):
        out = llm.create_completion(prompt, **sampling)
        text = out["choices"][0]["text"]
    else:
        out = llm.create_chat_completion(messages_for(prompt, system, image), **sampling)
        text = out["choices"][0]["message"]["content"] or ""
    usage = out["usage"]
    return Generation(
        model, prompt, text, out["choices"][0]["finish_reason"], usage["prompt_tokens"],
        usage["completion_tokens"], round(time.perf_counter() - start, 3),
    )


def open_model(path: str, *, n_ctx: int, gpu: bool, image: bool = False) -> tuple[Any, str]:
    """The GGUF at `path` loaded; `image`: with the projector file (mmproj-*.gguf) beside it, for chats
    with images."""
    model_path = runtime.resolve_model_path(path)
    trained = runtime.context_length(model_path)
    n_ctx = min(n_ctx, trained) if trained else n_ctx  # llama.cpp warns past the trained length
    mmproj = None
    if image:
        from unsloth.export.errors import ExportError

        mmproj = runtime.projector_for(model_path)
        if mmproj is None:
            raise ExportError(f"{model_path} has no projector file beside it ({runtime.MMPROJ_PREFIX}*.gguf), so it "
                              "cannot read images; nothing was run",
                              fix="export the vision-language model with `unsloth export CHECKPOINT --gguf q8_0`, "
                              "which writes the projector file next to the model, and chat with that folder")
    return runtime.load(model_path, n_ctx=n_ctx, gpu=gpu, mmproj=mmproj), str(model_path)
