"""TRL's trainers and configs as notebooks written for Unsloth call them, on current TRL and transformers.

After ``install()`` (run when the notebook facade is first used), ``from trl import SFTTrainer,
SFTConfig, GRPOTrainer, GRPOConfig, DPOTrainer, ...`` give subclasses of TRL's own classes that:

- map the legacy keywords onto the current API: ``tokenizer`` -> ``processing_class``, a config
  field given to the trainer (``dataset_text_field``, ``max_seq_length``, ``packing``, ...) -> the
  config, ``max_seq_length`` -> ``max_length``, ``evaluation_strategy`` -> ``eval_strategy``,
  ``warmup_ratio`` -> a fractional ``warmup_steps``;
- promote a plain ``TrainingArguments`` to the trainer's config class;
- drop the arguments TRL and transformers retired that change nothing, with one warning naming them,
  and refuse the ones whose meaning is lost, naming the replacement;
- choose bf16 / fp16 from the hardware when the notebook does not say, and fall back (with a
  warning) when it asks for a precision the machine cannot run, so a CPU or a T4 starts;
- fall back from a bitsandbytes optimizer (``optim="adamw_8bit"``) to PyTorch's AdamW, with a
  warning, where bitsandbytes cannot step it on this machine (``unsloth.training.optimizers``);
- raise GRPO's generation batch to a multiple of ``num_generations``, and (without vLLM) send its
  rollouts through our fast generation path (``unsloth.models.generation``);
- keep our fused cross-entropy as SFT's loss (TRL's own chunked LM head otherwise replaces it);
- give the preference trainers (DPO, KTO, ORPO, CPO / SimPO) our fused per-token log-probabilities
  (``unsloth.training.preference``).

Every mapping is decided by looking at the installed classes (their fields and signatures), so an
older TRL that still has a field receives it as it is. TRL's files are not changed: the module
attributes ``trl.SFTTrainer`` etc. are pointed at the subclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import math
from collections.abc import Mapping

from unsloth.errors import UnslothError
from unsloth.models import generation, whole_modules
from unsloth.training.optimizers import usable_optimizer
from unsloth.training import preference

log = logging.getLogger("unsloth")

# Trainer name -> its config class name, for the trainers notebooks use.
TRAINERS = {"SFTTrainer": "SFTConfig", "GRPOTrainer": "GRPOConfig", "DPOTrainer": "DPOConfig",
            "KTOTrainer": "KTOConfig", "ORPOTrainer": "ORPOConfig", "CPOTrainer": "CPOConfig",
            "RewardTrainer": "RewardConfig"}

# Old name -> current name; applied only when the class lacks the old one and has the new one.
RENAMED = {"max_seq_length": "max_length", "evaluation_strategy": "eval_strategy", "no_cuda": "use_cpu",
           "vllm_guided_decoding_regex": "vllm_structured_outputs_regex", "tokenizer": "processing_class"}
# Retired arguments that change nothing on a current install: dropped, with one warning.
RETIRED = {
    "overwrite_output_dir": "outputs are overwritten anyway",
    "logging_dir": "the trackers choose their own folders",
    "push_to_hub_token": "use hub_token", "push_to_hub_model_id": "use hub_model_id",
    "push_to_hub_organization": "use hub_model_id",
    "dataset_batch_size": "tokenization batches are the datasets library's",
    "num_of_sequences": "packing sizes rows from max_length", "chars_per_token": "packing counts tokens",
    "max_prompt_length": "prompts are no longer truncated by GRPO/DPO; truncate the dataset instead",
    "vllm_device": "vLLM runs where the trainer does", "vllm_dtype": "vLLM uses the model's dtype",
    "use_mps_device": "MPS is chosen automatically", "tpu_num_cores": "set by the launcher",
    "past_index": "no model uses it", "ray_scope": "set by Ray Tune", "jit_mode_eval": "removed",
    "use_ipex": "removed", "fp16_backend": "removed", "half_precision_backend": "removed",
}
# Arguments whose meaning is gone: refused with the replacement, never dropped silently.
REFUSED = {
    "model_init_kwargs": "the model is already loaded; pass its options to FastLanguageModel.from_pretrained",
}
# Keys of SFTConfig's `dataset_kwargs` that older TRL read and current TRL ignores (it reads only
# skip_prepare_dataset): dropped, with one warning that says what happens instead.
RETIRED_DATASET_KWARGS = {
    "add_special_tokens": "the tokenizer adds its special tokens once; a BOS the text already starts with is not doubled",
    "append_concat_token": "packing separates rows by their EOS",
}


class CompatError(UnslothError, TypeError):
    """A keyword a notebook passed that cannot be honoured: which, and what to write instead."""


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _parameters(cls) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}


def _rename(key: str, known: set[str]) -> str:
    new = RENAMED.get(key)
    return new if new and key not in known and new in known else key


def _unknown(key: str, known: set[str], where: str) -> CompatError:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"see the fields of {where}"
    return CompatError(f"{where} got an unexpected keyword argument {key!r}", fix=hint)


def normalize_config_kwargs(cls, kwargs: dict, where: str | None = None) -> dict:
    """`kwargs` for config class `cls`: renamed, retired ones dropped (one warning), unknown ones refused."""
    where = where or cls.__name__
    known = set(_fields(cls))
    out, dropped = {}, []
    for key, value in kwargs.items():
        key_now = _rename(key, known)
        if key == "warmup_ratio" and "warmup_ratio" not in known and "warmup_steps" in known:
            if value and "warmup_steps" in kwargs and kwargs["warmup_steps"]:
                raise CompatError(f"{where}: warmup_ratio and warmup_steps are both set",
                                  fix="keep one: warmup_steps takes a fraction of the run (0.1) or a step count")
            if value:
                out["warmup_steps"] = float(value)  # transformers 5: a warmup_steps below 1 is a ratio
            continue
        if key_now in known:
            if key_now in out and key_now != "warmup_steps":
                raise CompatError(f"{where}: {key!r} and {key_now!r} are the same setting, given twice",
                                  fix=f"keep {key_now!r}")
            if key_now == "warmup_steps" and key_now in out:
                if not value:
                    continue  # warmup_ratio set it; a zero warmup_steps beside it says nothing
                raise CompatError(f"{where}: warmup_ratio and warmup_steps are both set",
                                  fix="keep one: warmup_steps takes a fraction of the run (0.1) or a step count")
            if key_now == "dataset_kwargs" and isinstance(value, Mapping):
                value = _without_retired_dataset_kwargs(value, where)
            out[key_now] = value
        elif key in REFUSED and key not in known:
            raise CompatError(f"{where}: {key!r} is no longer supported", fix=REFUSED[key])
        elif key in RETIRED:
            dropped.append(key)
        else:
            raise _unknown(key, known, where)
    if dropped:
        log.warning("unsloth: %s: ignoring retired arguments that change nothing here: %s", where,
                    "; ".join(f"{k} ({RETIRED[k]})" for k in dropped))
    return out


def _without_retired_dataset_kwargs(value: Mapping, where: str) -> dict:
    retired = [k for k in value if k in RETIRED_DATASET_KWARGS]
    if retired:
        log.warning("unsloth: %s: ignoring dataset_kwargs that TRL no longer reads: %s", where,
                    "; ".join(f"{k} ({RETIRED_DATASET_KWARGS[k]})" for k in retired))
    return {k: v for k, v in value.items() if k not in RETIRED_DATASET_KWARGS}


# --- precision -----------------------------------------------------------------------------------

def hardware_precision() -> tuple[bool, bool]:
    """(bf16, fp16) mixed precision the machine runs: bf16 where supported, fp16 on older GPUs, none on a CPU."""
    import torch

    if torch.cuda.is_available():
        bf16 = torch.cuda.is_bf16_supported()
        return bf16, not bf16
    return False, False


def choose_precision(kwargs: dict, where: str) -> dict:
    """bf16 / fp16 from the hardware unless given; a precision the machine cannot run falls back, with a warning."""
    bf16_ok, fp16_ok = hardware_precision()
    bf16, fp16 = kwargs.get("bf16"), kwargs.get("fp16")
    if bf16 is None and fp16 is None:
        return {**kwargs, "bf16": bf16_ok, "fp16": fp16_ok}
    if bf16 is None:
        bf16 = bf16_ok and not fp16
    if fp16 is None:
        fp16 = False
    if (bf16 and not bf16_ok) or (fp16 and not (fp16_ok or bf16_ok)):
        asked = "bf16" if bf16 else "fp16"
        fallback = "fp16" if fp16_ok else "bf16" if bf16_ok else "float32"
        log.warning("unsloth: %s: %s=True asks for a mixed precision this machine cannot run (%s); "
                    "training in %s instead", where, asked, _machine(), fallback)
        bf16, fp16 = fallback == "bf16", fallback == "fp16"
    return {**kwargs, "bf16": bool(bf16), "fp16": bool(fp16)}


def _machine() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return f"{torch.cuda.get_device_name()} has no bfloat16"


# --- GRPO ----------------------------------------------------------------------------------------

def grpo_batch(kwargs: dict, fields: dict) -> dict:
    """Raise the generation batch to a multiple of num_generations, as Unsloth does (TRL refuses otherwise)."""
    if kwargs.get("generation_batch_size") is not None or kwargs.get("steps_per_generation") is not None:
        return kwargs
    value = lambda k: kwargs.get(k, fields[k].default)  # noqa: E731
    per_step = value("per_device_train_batch_size") * value("gradient_accumulation_steps")
    generations = value("num_generations")
    if not generations or per_step % generations == 0:
        return kwargs
    raised = math.lcm(per_step, generations)
    log.warning("unsloth: GRPOConfig: a batch of %d completions does not hold whole groups of num_generations=%d; "
                "generating %d per step (generation_batch_size)", per_step, generations, raised)
    return {**kwargs, "generation_batch_size": raised}


def grpo_sampling(kwargs: dict, fields: dict) -> dict:
    """Unsloth's `GRPOConfig(vllm_sampling_params=SamplingParams(...))` on a TRL without that field:
    the rollout options it holds go to TRL's own fields (temperature, top_p, top_k, min_p,
    repetition_penalty) unless the config sets them itself; stop strings and min_tokens go into
    generation_kwargs, under vLLM's names when vLLM generates and transformers' otherwise."""
    if "vllm_sampling_params" in fields:  # a TRL (or Unsloth) that has the field takes it as it is
        return kwargs
    from unsloth.models.sampling import sampling_fields, stop_strings

    out = {k: v for k, v in kwargs.items() if k != "vllm_sampling_params"}
    if kwargs.get("vllm_sampling_params") is None:
        return out
    params = sampling_fields(kwargs["vllm_sampling_params"])
    values = {"temperature": params["temperature"], "top_p": params["top_p"],
              "top_k": params["top_k"] if params["top_k"] and params["top_k"] > 0 else 0,
              "min_p": params["min_p"] or None, "repetition_penalty": params["repetition_penalty"]}
    out.update({k: v for k, v in values.items() if k in fields and k not in kwargs})
    vllm = out.get("use_vllm", fields["use_vllm"].default)
    extra = {}
    if stop_strings(params):
        extra["stop" if vllm else "stop_strings"] = stop_strings(params)
    if params["min_tokens"]:
        extra["min_tokens" if vllm else "min_new_tokens"] = params["min_tokens"]
    if extra and "generation_kwargs" in fields:
        out["generation_kwargs"] = {**extra, **(kwargs.get("generation_kwargs") or {})}
    return out


def grpo_rollouts(model, args) -> None:
    """Where GRPO's completions come from: vLLM (TRL's colocated engine) for a model loaded with
    fast_inference=True when vLLM can run and the config did not choose; else our fast path."""
    if getattr(model, "_unsloth_fast_inference", False) and not getattr(args, "_unsloth_use_vllm_given", True):
        from unsloth.models.loader import vllm_usable

        args.use_vllm = vllm_usable(model)
    if _ours_patched(model) and not args.use_vllm:
        generation.enable(model)  # the rollouts' model.generate: our fast path


# --- configs -------------------------------------------------------------------------------------

def compat_config(base):
    """A subclass of TRL config class `base` whose constructor accepts what the notebooks pass."""
    name = base.__name__

    def __init__(self, *args, **kwargs):
        if args:  # output_dir, positionally
            kwargs = {"output_dir": args[0], **kwargs}
        grpo = "num_generations" in _fields(base)
        if grpo:
            kwargs = grpo_sampling(kwargs, _fields(base))
        kwargs = normalize_config_kwargs(base, kwargs, name)
        kwargs = choose_precision(kwargs, name)
        if "optim" in kwargs:
            kwargs["optim"] = usable_optimizer(kwargs["optim"], name)
        if grpo:
            kwargs = grpo_batch(kwargs, _fields(base))
        kwargs.setdefault("report_to", "none")  # notebooks say so; a missing tracker must not stop the run
        base.__init__(self, **kwargs)
        if grpo:
            self._unsloth_use_vllm_given = "use_vllm" in kwargs

    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name,
                                "__doc__": base.__doc__})


def promote(args, config_cls, extra: dict):
    """`args` as an instance of `config_cls`, with `extra` (fields given to the trainer) applied."""
    if isinstance(args, config_cls):
        for key, value in extra.items():
            setattr(args, key, value)
        return args
    values = {k: getattr(args, k) for k in _fields(type(args)) if k in _fields(config_cls)}
    values["hub_token"] = getattr(args, "hub_token", None)  # TrainingArguments hides it from to_dict
    # A plain TrainingArguments said nothing about the TRL-only fields: their defaults apply.
    values.update(extra)
    return config_cls(**values)


# --- trainers ------------------------------------------------------------------------------------

def _check_once(key: str, key_now: str, kwargs: dict, out: dict, where: str) -> None:
    """Refuse an argument given under its old name and its current one (or twice after renaming)."""
    if key_now in out or (key_now in kwargs and key_now != key):
        raise CompatError(f"{where}: {key!r} and {key_now!r} are the same argument, given twice",
                          fix=f"keep {key_now!r}")


def normalize_trainer_kwargs(trainer_cls, config_cls, args, kwargs: dict) -> dict:
    """Trainer kwargs on the current API: renamed, config fields moved into `args`, `args` promoted."""
    where = trainer_cls.__name__
    accepted = _parameters(trainer_cls)
    config_fields = set(_fields(config_cls))
    out, moved = {}, {}
    for key, value in kwargs.items():
        key_now = _rename(key, accepted | config_fields)
        if key_now in accepted:
            _check_once(key, key_now, kwargs, out, where)
            out[key_now] = value
        elif key in config_fields or key_now in config_fields or key in RETIRED or key in REFUSED:
            moved[key] = value
        else:
            raise _unknown(key, accepted | config_fields, where)
    moved = normalize_config_kwargs(config_cls, moved, f"{where} (trainer-level options)") if moved else {}
    if args is None:
        args = config_cls(**{"output_dir": "outputs", **moved})
    else:
        args = promote(args, config_cls, moved)
    out["args"] = args
    return out


def _ours_patched(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "_unsloth_fused_loss", False))


def _checkpointing_is_ours(model, args) -> None:
    """Our per-layer checkpointing is already on: the Trainer's would recompute every layer twice.

    transformers 5.24 calls it `activation_checkpointing` (`gradient_checkpointing` is its alias): both
    go off, or TRL's reference pass (`disable_gradient_checkpointing`) turns the layers' own back on
    between a forward and its backward, and the recompute then differs from the forward.
    """
    if not getattr(model, "_unsloth_checkpointing", None):
        return
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, name, False):
            setattr(args, name, False)


def _one_bos(dataset, tokenizer, text_field: str):
    """Texts rendered by a chat template start with BOS, and tokenizing adds another: drop the written one."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or text_field not in getattr(dataset, "column_names", ()) or len(dataset) == 0:
        return dataset
    first = dataset[0][text_field]
    if not isinstance(first, str) or not first.startswith(bos):
        return dataset
    ids = tokenizer("a")["input_ids"]
    if not ids or ids[0] != tokenizer.bos_token_id:
        return dataset  # this tokenizer adds no BOS: the written one is the only one
    return dataset.map(lambda row: {text_field: row[text_field][len(bos):] if row[text_field].startswith(bos)
                                    else row[text_field]})


_CHAT_COLUMNS = ("messages", "conversations", "prompt", "completion")


def _text_field_first(dataset, text_field: str, formatting_func):
    """The text field the notebook names wins over chat columns left in the dataset (TRL would read those)."""
    columns = getattr(dataset, "column_names", None) or []
    if formatting_func is not None or text_field not in columns:
        return dataset
    chat = [c for c in _CHAT_COLUMNS if c in columns]
    return dataset.remove_columns(chat) if chat else dataset


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "moe_num_experts", "n_routed_experts")


def _no_aux_loss_without_experts(trainer) -> None:
    """TRL turns the MoE load-balancing loss on for any config with `output_router_logits` and a
    coefficient, and then reads the expert count; a dense model of an MoE family (Granite 4: no
    experts) has no routers, so TRL's loss would fail on it (no `num_experts`). Off for such models."""
    if not getattr(trainer, "aux_loss_enabled", False):
        return
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    counts = [getattr(config, name) for name in _EXPERT_COUNTS if isinstance(getattr(config, name, None), int)]
    if counts and not any(counts):
        trainer.aux_loss_enabled = False
        config.output_router_logits = False


def compat_trainer(base, config_cls):
    """A subclass of TRL trainer `base` that accepts the notebooks' keywords (and, for SFT, keeps our loss)."""
    name = base.__name__
    is_sft = name == "SFTTrainer"
    is_preference = name in preference.TRAINERS

    def __init__(self, *args, **kwargs):
        if args:  # model, positionally
            kwargs = {"model": args[0], **kwargs}
        trainer_args = kwargs.pop("args", None)
        kwargs = normalize_trainer_kwargs(base, config_cls, trainer_args, kwargs)
        if "model" in kwargs:
            _checkpointing_is_ours(kwargs["model"], kwargs["args"])
            if name == "GRPOTrainer":
                grpo_rollouts(kwargs["model"], kwargs["args"])
        for split in ("train_dataset", "eval_dataset"):
            if isinstance(kwargs.get(split), list):  # vision notebooks pass a list of conversations
                from datasets import Dataset

                kwargs[split] = Dataset.from_list(kwargs[split])
        if is_sft and kwargs.get("train_dataset") is not None:
            field = kwargs["args"].dataset_text_field
            data = _text_field_first(kwargs["train_dataset"], field, kwargs.get("formatting_func"))
            tokenizer = kwargs.get("processing_class")
            if tokenizer is not None:
                data = _one_bos(data, getattr(tokenizer, "tokenizer", tokenizer), field)
            kwargs["train_dataset"] = data
        base.__init__(self, **kwargs)
        _no_aux_loss_without_experts(self)
        whole_modules.train_in_float32(self.model)  # TRL casts a quantized model's trained weights to bf16
        if is_preference:
            preference.adopt(self)  # after TRL's own fused head is on: ours answers its calls

    def train(self, *args, **kwargs):
        check_memory(self)  # a run that cannot fit stops here, before the first step
        return base.train(self, *args, **kwargs)

    namespace = {"__init__": __init__, "__module__": __name__, "__qualname__": name, "__doc__": base.__doc__}
    if is_sft:
        namespace["compute_loss"] = _sft_compute_loss(base)
        namespace["train"] = train
        namespace["checks_memory"] = True
    namespace.update(preference.trainer_methods(name, base))
    return type(name, (base,), namespace)


def check_memory(trainer) -> None:
    """The run's memory estimate against the GPU's free memory (unsloth.training.memory), for a model we loaded."""
    from unsloth.training import memory

    model, args = trainer.model, trainer.args
    if not _ours_patched(model):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantization = getattr(base.config, "quantization_config", None)
    memory.check_before_training(
        model, batch=args.per_device_train_batch_size,
        seq=getattr(args, "max_length", None) or getattr(model, "max_seq_length", None) or 2048, optim=args.optim,
        checkpointing=getattr(model, "_unsloth_checkpointing", False) or False,
        full_finetuning=not hasattr(model, "peft_config"),
        load_in_4bit=bool(getattr(quantization, "load_in_4bit", False)), echo=log.info)


def _sft_compute_loss(base):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Our fused cross-entropy (the patched forward with labels) in place of TRL's chunked LM head.

        Only where nothing else needs TRL's per-token outputs: the plain "nll" loss, no custom loss
        function, no label smoothing, and a model whose fused loss passed its probe.
        """
        args = self.args
        if (return_outputs or args.loss_type != "nll" or self.compute_loss_func is not None
                or self.label_smoother is not None or getattr(self, "aux_loss_enabled", False)
                or not _ours_patched(model)):
            return base.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                     num_items_in_batch=num_items_in_batch)
        inputs = {**inputs, "use_cache": False}
        loss = model(**inputs, num_items_in_batch=num_items_in_batch).loss
        if args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.model.training:
            mask = inputs.get("attention_mask")
            count = mask.sum() if mask is not None else inputs["input_ids"].numel()
            self._total_train_tokens += int(self.accelerator.gather_for_metrics(
                count.reshape(1) if hasattr(count, "reshape") else count).sum()) // getattr(self, "_tp_size", 1)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return loss

    return compute_loss


# --- transformers' own trainers --------------------------------------------------------------------

# Trainers of transformers that notebooks build themselves (Whisper's Seq2SeqTrainer, OCR's Trainer).
TRANSFORMERS_TRAINERS = ("Trainer", "Seq2SeqTrainer")


def tokenizer_keyword_trainer(base):
    """A subclass of transformers trainer `base` that takes `tokenizer=` as `processing_class=` (the name
    transformers 5 keeps; notebooks pinned to transformers 4 pass the old one). Nothing else changes."""

    accepted = _parameters(base)

    def __init__(self, *args, **kwargs):
        renamed = {}
        for key, value in kwargs.items():
            key_now = _rename(key, accepted) if key == "tokenizer" else key
            _check_once(key, key_now, kwargs, renamed, base.__name__)
            renamed[key_now] = value
        base.__init__(self, *args, **renamed)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "__qualname__": base.__name__, "__doc__": base.__doc__})


def _install_transformers_trainers() -> None:
    import transformers

    for name in TRANSFORMERS_TRAINERS:
        base = getattr(transformers, name, None)
        if base is None or name in _INSTALLED:
            continue
        accepted = _parameters(base)
        if "tokenizer" in accepted or "processing_class" not in accepted:  # transformers 4 takes it as it is
            continue
        _INSTALLED[name] = cls = tokenizer_keyword_trainer(base)
        setattr(transformers, name, cls)


# --- installing ----------------------------------------------------------------------------------

_INSTALLED: dict[str, type] = {}


def install() -> dict[str, type]:
    """Point trl's trainer and config names at the compatible subclasses (once). Returns them by name."""
    if _INSTALLED:
        return _INSTALLED
    try:
        import trl
    except ImportError:
        _install_transformers_trainers()
        return _INSTALLED
    for trainer_name, config_name in TRAINERS.items():
        trainer, config = _trl_class(trl, trainer_name), _trl_class(trl, config_name)
        if trainer is None or config is None:
            continue
        compat_cfg = compat_config(config)
        compat_tr = compat_trainer(trainer, compat_cfg)
        for name, cls in ((config_name, compat_cfg), (trainer_name, compat_tr)):
            _INSTALLED[name] = cls
            globals()[name] = cls  # so pickles of a config (training_args.bin) find the class
            setattr(trl, name, cls)
    _install_transformers_trainers()  # after TRL's trainers are built: they keep transformers' own base
    return _INSTALLED


def _trl_class(trl, name: str):
    """trl.NAME, or where TRL moved it (ORPO lives in trl.experimental.orpo since TRL 0.26)."""
    import importlib
    import warnings

    try:
        return getattr(trl, name)
    except (AttributeError, ImportError):
        pass
    module = "trl.experimental." + name.removesuffix("Trainer").removesuffix("Config").lower()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's "experimental API" notice: the notebook asked for trl.NAME
            return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
