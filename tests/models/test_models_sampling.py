"""vLLM's SamplingParams read as transformers `generate` options (no model needed)."""

from __future__ import annotations

import types

import pytest

from unsloth.errors import UsageError
from unsloth.models.sampling import SamplingParams, generate_options, sampling_fields


def test_temperature_zero_is_greedy_and_sets_no_sampling_options():
    options = generate_options(SamplingParams(temperature=0, max_tokens=5))
    assert options == {"max_new_tokens": 5, "num_return_sequences": 1, "do_sample": False}


def test_sampling_sets_every_filter_so_the_models_generation_config_adds_none():
    options = generate_options(SamplingParams(temperature=0.8, top_p=0.95, top_k=-1, max_tokens=64))
    # vLLM's top_k=-1 is "off": 0 for transformers, not the generation_config's usual 50
    assert options == {"max_new_tokens": 64, "num_return_sequences": 1, "do_sample": True, "temperature": 0.8,
                       "top_p": 0.95, "top_k": 0, "min_p": None}
    assert generate_options({"temperature": 1.0, "top_k": 50, "min_p": 0.1})["top_k"] == 50
    assert generate_options({"temperature": 1.0, "min_p": 0.1})["min_p"] == 0.1


def test_stops_lengths_and_penalties():
    options = generate_options(SamplingParams(stop="</answer>", stop_token_ids=[7, 2], min_tokens=3,
                                              repetition_penalty=1.1, temperature=0, max_tokens=9), eos_token_id=2)
    assert options["stop_strings"] == ["</answer>"] and options["eos_token_id"] == [2, 7]
    assert options["min_new_tokens"] == 3 and options["repetition_penalty"] == 1.1
    assert generate_options(SamplingParams(ignore_eos=True, max_tokens=9))["min_new_tokens"] == 9
    assert generate_options(SamplingParams(n=4))["num_return_sequences"] == 4


def test_max_tokens_none_takes_the_room_left():
    assert generate_options(SamplingParams(max_tokens=None), max_new_tokens=100)["max_new_tokens"] == 100
    with pytest.raises(UsageError, match="max_tokens"):
        generate_options(SamplingParams(max_tokens=None), max_new_tokens=0)


def test_any_object_with_vllms_attribute_names_is_read():
    # vLLM's own SamplingParams is read by its attributes; what it lacks takes vLLM's defaults
    vllm_like = types.SimpleNamespace(temperature=0.5, top_p=0.9, max_tokens=7, seed=3)
    fields = sampling_fields(vllm_like)
    assert fields["temperature"] == 0.5 and fields["seed"] == 3 and fields["n"] == 1 and fields["top_k"] == 0
    assert sampling_fields(None) == sampling_fields(SamplingParams())


def test_what_cannot_be_honoured_is_refused_with_the_fix():
    with pytest.raises(UsageError, match="presence_penalty") as error:
        generate_options(SamplingParams(presence_penalty=0.5))
    assert "repetition_penalty" in error.value.fix
    with pytest.raises(UsageError, match="'max_new_token'"):
        sampling_fields({"max_new_token": 5})
