"""Talking to a checkpoint directory before it is exported: `unsloth chat` / `unsloth generate` on a
merged model or LoRA adapter folder (or the output folder of `unsloth train`), loaded with our
kernels and decoded on our fast generation path (``unsloth.models.generation``), with the chat
template its tokenizer carries. The calls mirror ``unsloth.export.chat`` (the GGUF side), so the
commands drive either one the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from unsloth.export.chat import Generation, messages_for
from unsloth.export.checkpoint import BASE_FIX, adapter_base, check_checkpoint, resolve_checkpoint
from unsloth.export.errors import ExportError


class CheckpointChat:
    """A checkpoint loaded for generation: `generate`, `stream`, `chat_stream`, as for a GGUF."""

    def __init__(self, model, tokenizer, path: Path, n_ctx: int):
        self.model, self.tokenizer, self.path, self.n_ctx = model, tokenizer, path, n_ctx

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def close(self) -> None:
        self.model = None

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]  # the template wrote BOS

    def _prompt_ids(self, prompt: str, raw: bool, system: str | None) -> list[int]:
        """The chat template's rendering of one user turn, or (raw, or no template) the text as it is."""
        if raw or not self.has_chat_template():
            return self.tokenizer(prompt)["input_ids"]
        return self._chat_ids(messages_for(prompt, system))

    def _options(self, prompt_tokens: int, max_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
        from unsloth.models.sampling import SamplingParams, generate_options

        if prompt_tokens + max_tokens > self.n_ctx:
            raise ValueError(f"the prompt ({prompt_tokens} tokens) and {max_tokens} new tokens do not fit "
                             f"the context of {self.n_ctx} tokens")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_tokens, seed=seed)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return {**generate_options(params), "pad_token_id": pad}

    def _run(self, ids: list[int], sampling: dict, streamer=None, stop: threading.Event | None = None) -> list[int]:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Stopped(StoppingCriteria):  # Ctrl-C in the chat: the reply ends at the next token
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop is not None and stop.is_set(), dtype=torch.bool,
                                  device=input_ids.device)

        options = self._options(len(ids), **sampling)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        torch.manual_seed(sampling["seed"])
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      streamer=streamer, stopping_criteria=StoppingCriteriaList([_Stopped()]),
                                      **options)
        return out[0, len(ids):].tolist()

    def _finish(self, new: list[int], max_tokens: int) -> tuple[list[int], str]:
        eos = self.model.generation_config.eos_token_id
        stops = {eos} if isinstance(eos, int) else set(eos or [])
        for k, token in enumerate(new):
            if token in stops:
                return new[:k], "stop"
        return new, "length" if len(new) >= max_tokens else "stop"

    def generate(self, prompt: str, *, raw: bool, system: str | None = None, **sampling: Any) -> Generation:
        """One reply, to the end, with its token counts (as ``unsloth.export.chat.generate``)."""
        start = time.perf_counter()
        ids = self._prompt_ids(prompt, raw, system)
        new, finish = self._finish(self._run(ids, sampling), sampling["max_tokens"])
        return Generation(str(self.path), prompt, self.tokenizer.decode(new, skip_special_tokens=True), finish,
                          len(ids), len(new), round(time.perf_counter() - start, 3))

    def stream(self, prompt: str, *, raw: bool, system: str | None = None, **sampling: Any) -> Iterator[dict]:
        yield from self._stream(self._prompt_ids(prompt, raw, system), sampling)

    def chat_stream(self, messages: list[dict[str, str]], **sampling: Any) -> Iterator[dict]:
        yield from self._stream(self._chat_ids(messages), sampling)

    def _stream(self, ids: list[int], sampling: dict) -> Iterator[dict]:
        """Text as it is decoded (generation runs in a thread); closing the iterator stops it."""
        from transformers import TextIteratorStreamer

        self._options(len(ids), **sampling)  # a prompt that does not fit fails here, before the thread
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        stop, result, failure = threading.Event(), [], []

        def work():
            try:
                result.append(self._run(ids, sampling, streamer, stop))
            except BaseException as exc:  # handed to the caller's thread below
                failure.append(exc)
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            for text in streamer:
                if text:
                    yield {"text": text, "finish_reason": None}
        finally:
            stop.set()
            thread.join()
        if failure:
            raise failure[0]
        yield {"text": "", "finish_reason": self._finish(result[0], sampling["max_tokens"])[1]}


def is_checkpoint(path: str | Path) -> bool:
    """A folder `open_checkpoint` reads (a model, adapters, or a training output holding them)."""
    try:
        resolve_checkpoint(path)
    except ExportError:
        return False
    return True


def open_checkpoint(path: str | Path, *, n_ctx: int, gpu: bool, load_in_4bit: bool = False) -> CheckpointChat:
    """A merged model or LoRA adapter directory (a training output: its merged/, else lora/) loaded
    with our kernels, on the GPU unless `gpu` is False, its generation on the fast path."""
    import torch

    from unsloth.models import generation
    from unsloth.models.loader import load_pretrained
    from unsloth.models.patches import patch_peft_model

    folder = resolve_checkpoint(path)
    check_checkpoint(folder)
    base = adapter_base(folder)
    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    options = dict(max_seq_length=n_ctx, load_in_4bit=load_in_4bit, dtype=None,
                   device_map=None if gpu and torch.cuda.is_available() else {"": "cpu"},
                   tokenizer_name=str(folder) if has_tokenizer or not base else None)
    try:
        model, tokenizer = load_pretrained(base or str(folder), **options)
        if base:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(folder))
            patch_peft_model(model)
    except OSError as exc:  # a missing base model or tokenizer, offline hub lookups
        raise ExportError(f"could not load {folder}: {exc}", fix=BASE_FIX) from exc
    trained = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    n_ctx = min(n_ctx, trained) if trained else n_ctx  # past the trained length the model says nothing useful
    model.eval()
    generation.enable(model)
    return CheckpointChat(model, tokenizer, folder, n_ctx)
