"""vLLM's generation calls as GRPO notebooks make them, answered by our generation path.

    from unsloth import SamplingParams          # or vLLM's own, where it is installed
    out = model.fast_generate([text], sampling_params=SamplingParams(temperature=0.8, max_tokens=256),
                              lora_request=model.load_lora("grpo_saved_lora"))
    out[0].outputs[0].text

Every prompt of a call decodes in one left-padded batch through ``unsloth.models.generation`` (a
static KV cache kept between calls, the decode step in CUDA graphs on a GPU). As with vLLM, a call
without a LoRA request answers with the base model and one with a request answers with those saved
adapters; the adapters being trained are put back afterwards, untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from pathlib import Path

from unsloth.errors import UsageError
from unsloth.models import generation
from unsloth.models.sampling import SamplingParams, generate_options, sampling_fields, stop_strings

__all__ = ["CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams", "fast_generate", "load_lora"]

log = logging.getLogger("unsloth")

_BATCH = 64  # prompts decoded together; a longer list runs in several batches
_ids = itertools.count(1)


class LoRARequest:
    """vLLM's LoRARequest (name, id, folder), holding the saved adapter tensors."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str, state: dict | None = None):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
        self.state = state

    def __repr__(self) -> str:
        return f"LoRARequest({self.lora_name!r}, {self.lora_int_id}, {self.lora_path!r})"


class CompletionOutput:
    """vLLM's CompletionOutput: one completion's text, token ids and why it ended."""

    def __init__(self, index: int, text: str, token_ids: list[int], finish_reason: str, stop_reason=None):
        self.index, self.text, self.token_ids = index, text, token_ids
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.cumulative_logprob = self.logprobs = None

    def __repr__(self) -> str:
        return f"CompletionOutput(index={self.index}, text={self.text!r}, finish_reason={self.finish_reason!r})"


class RequestOutput:
    """vLLM's RequestOutput: the prompt and its `n` completions (`outputs[0].text`)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], outputs: list):
        self.request_id, self.prompt, self.prompt_token_ids, self.outputs = request_id, prompt, prompt_token_ids, outputs
        self.finished = True

    def __repr__(self) -> str:
        return f"RequestOutput(prompt={self.prompt!r}, outputs={self.outputs!r})"


def _adapter_file(path: Path) -> Path:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise UsageError(f"load_lora: no adapter_model.safetensors in {path}",
                         fix="save the adapters there first with model.save_lora(path)")
    return weights


def load_lora(model, save_directory, load_tensors: bool = False) -> LoRARequest:
    """`model.load_lora(path)`: a request for the adapters saved in `path` (by save_lora / save_pretrained)."""
    from safetensors.torch import load_file

    path = Path(save_directory)
    state = load_file(str(_adapter_file(path)))
    return LoRARequest(path.name, next(_ids), str(path), state)


def _prompt_ids(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """vLLM's prompt forms: a string, {"prompt": str} or {"prompt_token_ids": [...]}."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if not isinstance(prompt, str):
        raise UsageError(f"fast_generate: a prompt must be a string, {{'prompt': str}} or "
                         f"{{'prompt_token_ids': [...]}}, not {type(prompt).__name__}",
                         fix="pass the text the chat template rendered (apply_chat_template(..., tokenize=False))")
    # the text already holds what the template wrote (BOS included), as vLLM reads it
    return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]


def fast_generate(model, prompts, sampling_params=None, lora_request=None, use_tqdm: bool = False, **kwargs):
    """`model.fast_generate(prompts, sampling_params=..., lora_request=...)`: vLLM's `LLM.generate`.

    `sampling_params`: ours, vLLM's or a dict of its names (one for every prompt); keywords beyond
    vLLM's are `generate` options passed through. Returns one RequestOutput per prompt, in order."""
    import torch

    tokenizer = model._unsloth_tokenizer
    single = isinstance(prompts, (str, dict))
    requests = [_prompt_ids(tokenizer, p) for p in ([prompts] if single else list(prompts))]
    fields = sampling_fields(sampling_params)
    results = []
    with _answering_model(model, lora_request), torch.no_grad():
        for start in range(0, len(requests), _BATCH):
            results += _generate_batch(model, tokenizer, requests[start:start + _BATCH], fields, kwargs,
                                       first_id=start)
    return results


def _generate_batch(model, tokenizer, requests, fields, extra: dict, first_id: int) -> list[RequestOutput]:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = max(len(ids) for _, ids in requests)
    # left padding: every row's next token comes at the same position
    input_ids = torch.tensor([[pad] * (longest - len(ids)) + ids for _, ids in requests])
    attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for _, ids in requests])
    device = next(model.parameters()).device
    room = getattr(model, "max_seq_length", None)
    eos = model.generation_config.eos_token_id
    options = generate_options(fields, eos_token_id=eos, max_new_tokens=None if room is None else room - longest)
    n = options.pop("num_return_sequences")
    if options["do_sample"]:
        options["num_return_sequences"] = n  # greedy: one decode, repeated n times as vLLM would give
    options = {"pad_token_id": pad, **options, **extra}
    if "stop_strings" in options:
        options["tokenizer"] = tokenizer
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) if fields["seed"] is not None \
        else contextlib.nullcontext()
    with rng:
        if fields["seed"] is not None:
            torch.manual_seed(fields["seed"])
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **options)
    out = out[:, longest:].tolist()
    per_prompt = options.get("num_return_sequences", 1)
    stops = set(options.get("eos_token_id") or ([eos] if isinstance(eos, int) else eos or []))
    outputs = []
    for i, (text, ids) in enumerate(requests):
        rows = out[i * per_prompt:(i + 1) * per_prompt]
        rows = rows if per_prompt == n else rows * n
        completions = [_completion(k, row, stops, tokenizer, fields) for k, row in enumerate(rows)]
        outputs.append(RequestOutput(str(first_id + i), text, ids, completions))
    return outputs


def _completion(index: int, row: list[int], stops: set, tokenizer, fields: dict) -> CompletionOutput:
    """One completion as vLLM reports it: tokens up to and including a stop token (no padding after),
    text cut before a stop string (kept when include_stop_str_in_output)."""
    finish, reason = "length", None
    for k, token in enumerate(row):
        if token in stops and not fields["ignore_eos"]:
            row, finish, reason = row[:k + 1], "stop", token
            break
    text = tokenizer.decode(row, skip_special_tokens=fields["skip_special_tokens"])
    for stop in stop_strings(fields):
        at = text.find(stop)
        if at >= 0:
            text = text[:at + len(stop)] if fields["include_stop_str_in_output"] else text[:at]
            finish, reason = "stop", stop
            break
    return CompletionOutput(index, text, row, finish, reason)


@contextlib.contextmanager
def _answering_model(model, lora_request):
    """The model in eval mode on the fast generation path, with the adapters the request names: none
    (the base model) without a request, the saved ones with one. Everything is put back after."""
    config = model.config
    use_cache, was_training = config.use_cache, model.training
    peft = hasattr(model, "disable_adapter")
    if lora_request is None:
        adapters = model.disable_adapter() if peft else contextlib.nullcontext()
    elif not peft:
        raise UsageError("fast_generate: a lora_request needs a model with LoRA adapters",
                         fix="call FastLanguageModel.get_peft_model(model, ...) first, with the saved adapters' rank")
    else:
        state = getattr(lora_request, "state", None)
        if state is None:  # vLLM's own LoRARequest names only the folder
            from safetensors.torch import load_file

            state = load_file(str(_adapter_file(Path(lora_request.lora_path))))
        adapters = _adapters(model, state)
    generation.enable(model)  # idempotent; its caches stay for the next call
    model.eval()
    try:
        with adapters:
            yield
    finally:
        model.train(was_training)
        config.use_cache = use_cache


@contextlib.contextmanager
def _adapters(model, state: dict):
    """The model's LoRA weights replaced by `state` (a saved adapter) for the duration."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    saved = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    set_peft_model_state_dict(model, state)
    try:
        yield
    finally:
        set_peft_model_state_dict(model, saved)
