"""vLLM's generation calls as GRPO notebooks make them, answered by our generation path.

``model.fast_generate(prompts, sampling_params=..., lora_request=model.load_lora(path))`` returns
objects shaped like vLLM's RequestOutput (``[0].outputs[0].text``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping


class LoRARequest:
    """What `load_lora` returns and `fast_generate(lora_request=...)` takes: adapters saved in a folder."""

    def __init__(self, path: str, state: dict):
        self.lora_path, self.state = path, state

    def __repr__(self) -> str:
        return f"LoRARequest({self.lora_path!r})"


def load_lora(model, save_directory, load_tensors: bool = False):
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(save_directory)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"load_lora: no adapter_model.safetensors in {path} (save it with model.save_lora)")
    return LoRARequest(str(path), load_file(str(weights)))


def _generation_kwargs(sampling_params, kwargs: dict) -> dict:
    """vLLM's SamplingParams (or a dict of the same names) as `generate` keywords."""
    if sampling_params is None:
        params = {}
    elif isinstance(sampling_params, Mapping):
        params = dict(sampling_params)
    else:
        params = {k: getattr(sampling_params, k) for k in ("temperature", "top_p", "top_k", "max_tokens",
                                                             "repetition_penalty", "min_p", "seed")
                  if getattr(sampling_params, k, None) is not None}
    out = {"max_new_tokens": params.pop("max_tokens", 16)}
    temperature = params.pop("temperature", 1.0)
    out["do_sample"] = temperature > 0
    if temperature > 0:
        out["temperature"] = temperature
        for key in ("top_p", "min_p", "repetition_penalty"):
            if key in params:
                out[key] = params[key]
        if params.get("top_k", -1) and params.get("top_k", -1) > 0:
            out["top_k"] = params["top_k"]
    return {**out, **kwargs}


class _Completion:
    def __init__(self, text: str, token_ids: list[int]):
        self.text, self.token_ids = text, token_ids


class _RequestOutput:
    """The shape of vLLM's RequestOutput that notebooks read: `outputs[0].text`."""

    def __init__(self, prompt: str, completion: _Completion):
        self.prompt, self.outputs = prompt, [completion]


def fast_generate(model, prompts, sampling_params=None, lora_request=None, use_tqdm=False, **kwargs):
    """`model.fast_generate(texts, sampling_params=..., lora_request=...)`: vLLM's call, run by `generate`.

    Without a LoRA request the base model answers (as with vLLM, where adapters are opt-in per request);
    with one, those saved adapters do.
    """
    import torch

    tokenizer = model._unsloth_tokenizer
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    options = _generation_kwargs(sampling_params, kwargs)
    options.setdefault("pad_token_id", tokenizer.pad_token_id)
    peft = hasattr(model, "disable_adapter")
    if lora_request is None and peft:
        context = model.disable_adapter()
    elif lora_request is not None:
        context = _adapters(model, lora_request.state)
    else:
        context = contextlib.nullcontext()
    results = []
    was_training = model.training
    model.eval()
    try:
        with context, torch.no_grad():
            for text in texts:
                batch = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(_device(model))
                out = model.generate(**batch, **options)[0, batch["input_ids"].shape[1]:]
                results.append(_RequestOutput(text, _Completion(tokenizer.decode(out, skip_special_tokens=True),
                                                                out.tolist())))
    finally:
        model.train(was_training)
    return results


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


def _device(model):
    return next(model.parameters()).device
