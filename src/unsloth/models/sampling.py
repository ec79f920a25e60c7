"""vLLM's sampling options (`SamplingParams`) as transformers `generate` options.

Notebooks written for vLLM describe a request with vLLM's names (temperature 0 is greedy, top_k -1
is off, max_tokens, min_tokens, stop strings, seed, n). `SamplingParams` here has those names and
defaults, for machines without vLLM; `generate_options` reads either it, vLLM's own class or a
dict of the same names, so the same cell runs on our generation path whichever is installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from unsloth.errors import UsageError

__all__ = ["SamplingParams", "generate_options", "sampling_fields"]


@dataclasses.dataclass
class SamplingParams:
    """vLLM's SamplingParams: the options our generation path honours, with vLLM's defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # accepted; completions carry no log-probabilities here


_NAMES = [f.name for f in dataclasses.fields(SamplingParams)]
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


class SamplingError(UsageError, ValueError):
    """A sampling option our generation path cannot honour."""


def sampling_fields(params) -> dict:
    """The options of `params` (ours, vLLM's, a dict or None) by vLLM's names, defaults filled in."""
    if params is None:
        return dict(_DEFAULTS)
    if isinstance(params, Mapping):
        unknown = sorted(set(params) - set(_NAMES))
        if unknown:
            raise SamplingError(f"sampling options {', '.join(map(repr, unknown))} are not vLLM SamplingParams names",
                                fix=f"use the names {', '.join(_NAMES)}")
        return {**_DEFAULTS, **params}
    return {name: getattr(params, name, default) for name, default in _DEFAULTS.items()}


def stop_strings(fields: dict) -> list[str]:
    stop = fields["stop"]
    return [stop] if isinstance(stop, str) else list(stop or [])


def generate_options(params, eos_token_id: int | Sequence[int] | None = None, max_new_tokens: int | None = None) -> dict:
    """`generate` keywords doing what `params` asks. `eos_token_id`: the model's, which stop_token_ids
    extend; `max_new_tokens`: the room left when max_tokens is None (vLLM: up to the context length)."""
    fields = sampling_fields(params)
    for penalty in ("presence_penalty", "frequency_penalty"):
        if fields[penalty]:
            raise SamplingError(f"{penalty}={fields[penalty]} has no equivalent on this generation path",
                                fix="use repetition_penalty (above 1.0 discourages repeats), or install vLLM")
    new = fields["max_tokens"] if fields["max_tokens"] is not None else max_new_tokens
    if new is None or new < 1:
        raise SamplingError(f"max_tokens={fields['max_tokens']} leaves no tokens to generate",
                            fix="set max_tokens to 1 or more")
    options = {"max_new_tokens": new, "num_return_sequences": fields["n"]}
    if fields["ignore_eos"]:
        options["min_new_tokens"] = new
    elif fields["min_tokens"]:
        options["min_new_tokens"] = fields["min_tokens"]
    greedy = not fields["temperature"] or fields["temperature"] < 1e-5  # vLLM's own threshold
    options["do_sample"] = not greedy
    if not greedy:
        top_k = fields["top_k"] if fields["top_k"] and fields["top_k"] > 0 else 0
        # every field set: the model's generation_config (top_k=50, say) must not add its own
        options.update(temperature=float(fields["temperature"]), top_p=float(fields["top_p"]), top_k=top_k,
                       min_p=float(fields["min_p"]) or None)
    if fields["repetition_penalty"] != 1.0:
        options["repetition_penalty"] = float(fields["repetition_penalty"])
    if fields["stop_token_ids"]:
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        options["eos_token_id"] = eos + [t for t in fields["stop_token_ids"] if t not in eos]
    if stop_strings(fields):
        options["stop_strings"] = stop_strings(fields)
    return options
