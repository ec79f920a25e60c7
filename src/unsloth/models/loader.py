"""Loading a causal LM with our kernels patched in, and adding LoRA adapters to it.

Loading goes through transformers, LoRA through peft; our part is the patches (kernels) and
gradient checkpointing with offload. The notebook facade (``unsloth.notebook``) and the trainer
(``unsloth.training``) both load through here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from pathlib import Path

import torch

from unsloth.errors import UnslothError
from unsloth.models.bnb_layout import keep_4bit_layout
from unsloth.models.distributed import bind_to_gpu_numa_node, destroy_process_group_at_exit, rank_device, world_size
from unsloth.models.embedding import offload_input_embedding
from unsloth.models.module_tree import cheap_trainer_calls
from unsloth.models.patches import patch_model, patch_peft_model
from unsloth.models.speech import CODEC_MODULES, codec_of
from unsloth.models.checkpointing import apply_gradient_checkpointing
from unsloth.models import whole_modules
from unsloth.models.chat_ids import returns_ids_by_default

log = logging.getLogger("unsloth")

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Options of the original Unsloth API that change nothing here: accepted so notebooks run as they are.
_ACCEPTED_UNUSED = {
    "fix_tokenizer", "use_exact_model_name", "resize_model_vocab", "float8_kv_cache", "disable_log_stats",
    "max_lora_rank", "gpu_memory_utilization", "float32_mixed_precision", "text_only",
    "unsloth_tiled_mlp", "qat_scheme", "load_in_16bit", "load_in_fp8", "ensure_weight_tying",
    "unsloth_force_compile",
}


def refuse_qat(qat_scheme) -> None:
    """qat_scheme (quantization-aware training) needs torchao's fake-quantized layers, which we do not run;
    training on without them would hand back a model that only looks quantization-aware."""
    if qat_scheme is None:
        return
    raise UnslothError(
        f"qat_scheme={qat_scheme!r}: quantization-aware training (torchao fake quantization) is not supported",
        "remove qat_scheme to train as usual, then export with save_pretrained_merged or save_pretrained_gguf "
        "(quantization_method='q4_k_m' for a 4-bit model); the notebook's torchao cells (quantize_, "
        "save_pretrained_torchao) need torchao and do not run here", kept="nothing was changed")


def is_bfloat16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _default_dtype() -> torch.dtype:
    if is_bfloat16_supported():
        return torch.bfloat16
    return torch.float16 if torch.cuda.is_available() else torch.float32


def _resolve_dtype(dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return _default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype; use bfloat16, float16, float32 or auto")
        return resolved
    return dtype


_PREQUANTIZED = ("-unsloth-bnb-4bit", "-bnb-4bit")


def resolve_model_name(model_name: str, load_in_4bit: bool) -> str:
    """A hub `...-bnb-4bit` name (a prequantized 4-bit checkpoint) loads as it is when 4-bit is wanted
    and bitsandbytes is there; otherwise its base model's name, with a note. Local folders are kept."""
    if Path(model_name).expanduser().exists():
        return model_name
    suffix = next((s for s in _PREQUANTIZED if model_name.lower().endswith(s)), None)
    if suffix is None:
        return model_name
    if load_in_4bit and importlib.util.find_spec("bitsandbytes") is not None:
        return model_name
    base = model_name[: -len(suffix)]
    why = "load_in_4bit=False" if not load_in_4bit else "bitsandbytes is not installed"
    log.warning("unsloth: %s is prequantized to 4 bits and %s: loading its base model %s", model_name, why, base)
    return base


def _checkpoint_dtype(model_name: str, token, revision, trust_remote_code) -> torch.dtype | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_name, token=token, revision=revision,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _quantization_config(load_in_4bit: bool, load_in_8bit: bool, dtype: torch.dtype):
    if not (load_in_4bit or load_in_8bit):
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        log.warning("unsloth: bitsandbytes is not installed, so the weights load in 16-bit "
                    "(`pip install bitsandbytes` for 4-bit / 8-bit).")
        return None
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        problem = int8_problem(device)
        if problem is not None:
            raise UnslothError(f"load_in_8bit: {problem}",
                               "load_in_4bit=True (QLoRA, which bitsandbytes also runs on the CPU), 16-bit LoRA "
                               "(both false), or train on a GPU", kept="nothing was loaded")
        return BitsAndBytesConfig(load_in_8bit=True)
    # In a job of several processes the packed 4-bit bytes are stored as the compute dtype, so FSDP
    # can shard them with the layer's other weights (one dtype per layer); our kernels read them as bytes.
    storage = dtype if world_size() > 1 else torch.uint8
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=storage)


@functools.lru_cache(maxsize=None)
def int8_problem(device_type: str) -> str | None:
    """None when bitsandbytes runs its 8-bit (LLM.int8) linear layer forward and backward on
    `device_type` (tried on a small one), else why not: older builds have no CPU int8 kernels."""
    import bitsandbytes as bnb

    try:
        dense = torch.nn.Linear(64, 32)
        layer = bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False)
        layer.load_state_dict(dense.state_dict())
        layer = layer.to(device_type)  # quantizes the weight to int8
        x = torch.randn(4, 64, device=device_type, dtype=torch.float16, requires_grad=True)
        y = layer(x)
        y.float().sum().backward()
        if layer.weight.dtype != torch.int8 or x.grad is None or not bool(torch.isfinite(y).all()):
            return f"bitsandbytes {bnb.__version__} did not run an 8-bit layer on {device_type}"
    except Exception as exc:  # noqa: BLE001 - a missing kernel surfaces as many kinds of error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return f"bitsandbytes {bnb.__version__} cannot run 8-bit (LLM.int8) layers on {device_type} ({first})"
    return None


# attn_implementation -> the class attribute by which a transformers model says it supports it
_ATTENTION_SUPPORT = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def choose_attention(model_class, requested: str | None) -> tuple[str | None, str | None]:
    """The attention implementation to load `model_class` with, and why it is not `requested` (or None).

    A model that does not support the requested one (gpt-oss has no SDPA path) gets SDPA where it
    has it, else eager, instead of failing to load. Unknown classes (remote code) and requests we do
    not know are passed to transformers as they are.
    """
    flag = _ATTENTION_SUPPORT.get(requested)
    if model_class is None or flag is None or getattr(model_class, flag, True):
        return requested, None
    fallback = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    why = f"{model_class.__name__} does not support attn_implementation={requested!r}, so it loads with {fallback!r}"
    return fallback, why


def sub_model_attention(config, requested):
    """`requested` for a composite model (text, vision, audio sub-configs): a {sub-config: implementation}
    dict, as transformers takes it, where one of its sub-models does not support it (Gemma 4's audio
    tower has no SDPA path and fails to load when asked for it); those get choose_attention's fallback.
    `requested` itself otherwise."""
    from transformers import AutoModel

    if not isinstance(requested, str):
        return requested
    per_part, why = {}, []
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is None:
            continue
        try:
            model_class = AutoModel._model_mapping[type(sub)]
        except KeyError:  # a part transformers builds inside its parent only (Gemma 4's vision tower)
            model_class = None
        per_part[key], reason = choose_attention(model_class, requested)
        why += [reason] if reason else []
    if not why:
        return requested
    log.info("unsloth: %s.", "; ".join(why))
    return {"": requested, **per_part}


def _causal_lm_class(model_name: str, auto_class=None, **options):
    """The transformers class `auto_class` (AutoModelForCausalLM) would build for `model_name`, or None
    if it is not a built-in one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        return (auto_class or AutoModelForCausalLM)._model_mapping[type(AutoConfig.from_pretrained(model_name, **options))]
    except Exception:  # remote code, or a name transformers does not map: it decides itself
        return None


def checkpoint_quant_method(model_name: str, **hub) -> str | None:
    """The quantization a checkpoint was published in (its config's quant_method), or None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_name, **hub)
    except (OSError, ValueError):  # not readable here: from_pretrained will say why
        return None
    quant = getattr(config, "quantization_config", None)
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)


def _published_quantization(model_name: str, dtype: torch.dtype, **hub):
    """A loading config for checkpoints published quantized, or None. MXFP4 (gpt-oss) has no
    backward: its experts are dequantized on load with transformers' own path, and LoRA trains on them."""
    if checkpoint_quant_method(model_name, **hub) != "mxfp4":
        return None
    from transformers import Mxfp4Config

    log.info("unsloth: %s is MXFP4; its experts are dequantized to %s on load (MXFP4 cannot be trained).",
             model_name, dtype)
    return Mxfp4Config(dequantize=True)


def vllm_usable(model) -> bool:
    """vLLM can generate for this model: installed, and the model is on a GPU."""
    device = next(model.parameters()).device
    return device.type == "cuda" and importlib.util.find_spec("vllm") is not None


def _prepare_tokenizer(processing, max_seq_length: int):
    """The tokenizer (a processor's own, for vision models) set up for batches; returns `processing`."""
    tokenizer = getattr(processing, "tokenizer", processing)
    tokenizer.model_max_length = max_seq_length
    if tokenizer is processing:  # a processor's apply_chat_template is its own
        returns_ids_by_default(tokenizer)
    if tokenizer.pad_token is None:  # batches need one; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"
    return processing


def load_pretrained(
    model_name: str = "unsloth/Llama-3.2-1B-Instruct",
    max_seq_length: int | None = 2048,
    dtype=None,
    load_in_4bit: bool = True,
    load_in_8bit: bool = False,
    full_finetuning: bool = False,
    token: str | None = None,
    device_map=None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    use_gradient_checkpointing: bool | str = "unsloth",
    random_state: int = 3407,
    attn_implementation: str = "sdpa",
    fast_inference: bool = False,
    rope_scaling=None,
    tokenizer_name: str | None = None,
    offload_embedding: bool | None = None,
    auto_class=None,
    load_tokenizer=None,
    **kwargs,
):
    """Load a causal LM and its tokenizer, with our kernels patched in. Returns (model, tokenizer).

    `fast_inference`: GRPO rollouts through vLLM (TRL's colocated engine) where it is installed and
    the model is on a GPU; elsewhere through our own fast generation path, which `model.fast_generate`
    always uses (unsloth.models.generation).

    `offload_embedding`: keep the (frozen) input embedding in pinned host memory during LoRA
    training (unsloth.models.embedding). None: whenever it can; False: never; True: also say why
    when it cannot. `auto_class` and `load_tokenizer` (name, **hub options) replace
    AutoModelForCausalLM and AutoTokenizer.from_pretrained (the vision loader passes its own).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    auto_class = auto_class or AutoModelForCausalLM
    load_tokenizer = load_tokenizer or AutoTokenizer.from_pretrained
    refuse_qat(kwargs.get("qat_scheme"))
    ignored = sorted(set(kwargs) & _ACCEPTED_UNUSED)
    for name in ignored:
        kwargs.pop(name)
    if ignored:
        log.info("unsloth: ignoring options that change nothing here: %s", ", ".join(ignored))
    torch.manual_seed(random_state)
    auto_dtype = dtype is None or dtype == "auto"
    dtype = _resolve_dtype(dtype)
    if full_finetuning and (load_in_4bit or load_in_8bit):
        log.info("unsloth: full fine-tuning trains every weight, so they load in %s, not quantized.", dtype)
        load_in_4bit = load_in_8bit = False
    if world_size() > 1:
        destroy_process_group_at_exit()  # the trainer starts the group; nothing in a notebook ends it
    if device_map is None and torch.cuda.is_available():
        # Under torchrun / accelerate each rank loads onto its own GPU, next to its own CPUs.
        device_map = {"": rank_device()}
        cpus = bind_to_gpu_numa_node(device_map[""])
        if cpus:
            log.info("unsloth: rank on GPU %d runs on its NUMA node's CPUs (%d of them)", device_map[""], len(cpus))
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    model_name = resolve_model_name(model_name, load_in_4bit)
    if Path(model_name).expanduser().is_dir():
        # peft writes this name into adapter_config.json as the base model; a relative path would
        # later resolve against whatever directory the export runs from.
        model_name = str(Path(model_name).expanduser().resolve())
    hub_options = dict(token=token, revision=revision, trust_remote_code=trust_remote_code,
                       **{k: v for k, v in kwargs.items() if k in ("local_files_only", "cache_dir")})
    model_class = _causal_lm_class(model_name, auto_class, **hub_options)
    attn_implementation, why = choose_attention(model_class, attn_implementation)
    if why:
        log.warning("unsloth: %s.", why)
    if getattr(getattr(model_class, "config_class", None), "sub_configs", None):  # a composite model
        from transformers import AutoConfig

        attn_implementation = sub_model_attention(AutoConfig.from_pretrained(model_name, **hub_options),
                                                  attn_implementation)
    published = _published_quantization(model_name, dtype, **hub_options)
    with _experts_in_4bit_while_loading(load_in_4bit and not full_finetuning):
        model = auto_class.from_pretrained(
            model_name,
            dtype=dtype,
            device_map=device_map,
            quantization_config=published or _quantization_config(load_in_4bit, load_in_8bit, dtype),
            token=token,
            revision=revision,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            **kwargs,
        )
    tokenizer = load_tokenizer(tokenizer_name or model_name, **hub_options)
    if max_seq_length is None:  # as Unsloth: the context the model was trained for
        config = model_config(model)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        max_seq_length = getattr(config, "max_position_embeddings", None) or 2048
    model.max_seq_length = max_seq_length
    if auto_dtype:  # the checkpoint's own dtype, for saves: float32 on a CPU is a compute choice, not the model's
        model._unsloth_source_dtype = _checkpoint_dtype(model_name, token, revision, trust_remote_code)
    model._unsloth_offload_embedding = offload_embedding
    model._unsloth_fast_inference = bool(fast_inference)
    if fast_inference and not vllm_usable(model):
        log.info("unsloth: fast_inference=True: vLLM is not %s, so generation (GRPO rollouts, fast_generate) runs "
                 "on unsloth's static-cache path%s.", "installed (`unsloth install --with vllm` adds it where its "
                 "wheels exist)" if importlib.util.find_spec("vllm") is None else "used off a GPU",
                 " with CUDA graphs" if torch.cuda.is_available() else "")
    keep_4bit_layout(model)
    model._unsloth_full_finetuning = bool(full_finetuning)
    patch_model(model)
    cheap_trainer_calls(model)
    if full_finetuning:
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
        model._unsloth_checkpointing = use_gradient_checkpointing
        _record_checkpointing(model, apply_gradient_checkpointing(model, use_gradient_checkpointing),
                              use_gradient_checkpointing)
        _say_what_is_fast(model)
    else:
        model.requires_grad_(False)  # LoRA adapters come next and are the only trainable weights
        if load_in_4bit:
            _quantize_experts(model)
    return model, _prepare_tokenizer(tokenizer, max_seq_length)


def _experts_in_4bit_while_loading(wanted: bool):
    """QLoRA of packed MoE experts: their stacks are quantized as the checkpoint loads (one at a time),
    so loading never holds the 16-bit experts of more than about one layer (experts_4bit)."""
    if not wanted or importlib.util.find_spec("bitsandbytes") is None:
        return contextlib.nullcontext()
    from unsloth.models.experts_4bit import quantize_experts_on_load
    from unsloth.models.patches.moe import holds_expert_stacks

    return quantize_experts_on_load(holds_expert_stacks)


def _quantize_experts(model) -> None:
    """QLoRA of packed MoE experts: bitsandbytes quantizes nn.Linear layers only, so their stacks (most
    of the model) are quantized by us: on load, and here any the load left dense (not from the
    checkpoint). The ones our kernel does not run are dequantized back, after the experts patch."""
    from unsloth.models.patches.moe import experts_modules, holds_expert_stacks

    experts = experts_modules(model)
    if importlib.util.find_spec("bitsandbytes") is None:
        if experts:
            log.warning("unsloth: bitsandbytes is not installed, so the MoE experts stay %s.", model.dtype)
        return
    from unsloth.models.experts_4bit import dequantize_packed_experts, quantize_packed_experts

    unpatched = [m for m in model.modules() if holds_expert_stacks(m) and "_unsloth_moe" not in m.__dict__]
    dequantize_packed_experts(model, unpatched)
    stacks = quantize_packed_experts(model)
    unpatched = sum(1 for m in experts if "_unsloth_moe" not in m.__dict__)
    if unpatched:
        log.warning("unsloth: %d MoE experts modules run transformers' own code, so their weights stay %s "
                    "(only the ones our kernel runs are quantized).", unpatched, model.dtype)  # fmt: skip
    report = getattr(model, "_unsloth_patches", None)
    if report is not None:
        report.moe_4bit = stacks


def _targets_peft_accepts(model, target_modules: list[str]) -> list[str]:
    """`target_modules` less the names peft's own check refuses on `model`: LoRA on a Mamba layer's
    out_proj or conv1d (Nemotron-H, Falcon-H1), whose fused Mamba kernels read those weights directly,
    so an adapter there would not train. The Nemotron notebook names out_proj; peft would stop it."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    check = getattr(LoraModel, "_check_target_module_compatiblity", None)
    if check is None:
        return target_modules
    probe = LoraConfig(target_modules=target_modules, task_type="CAUSAL_LM")
    refused = []
    for name in target_modules:
        try:
            check(None, probe, model, name.rsplit(".", 1)[-1])  # peft checks the last part of a module name
        except ValueError:
            refused.append(name)
    kept = [name for name in target_modules if name not in refused]
    if refused and kept:
        log.warning("unsloth: no LoRA on %s: peft refuses adapters there on %s (its fused Mamba kernels read those "
                    "weights directly, so they would not train); the other targets are adapted.",
                    ", ".join(refused), getattr(model.config, "model_type", type(model).__name__))
        return kept
    return target_modules  # nothing refused, or everything: peft says why


def add_lora(
    model,
    r: int = 16,
    target_modules=None,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    bias: str = "none",
    layers_to_transform=None,
    layers_pattern=None,
    use_gradient_checkpointing: bool | str = "unsloth",
    random_state: int = 3407,
    max_seq_length: int | None = None,
    use_rslora: bool = False,
    modules_to_save=None,
    init_lora_weights=True,
    loftq_config=None,
    task_type: str | None = "CAUSAL_LM",
    **kwargs,
):
    """Add LoRA adapters (peft) and route the LoRA layers through our fast paths. Returns the PeftModel.

    `task_type`: peft's wrapper, as in peft: "CAUSAL_LM", "SEQ_CLS" (the classifier head is trained
    and saved in full), None (the plain PeftModel, whose forward passes everything through: Whisper)."""
    from peft import LoraConfig, get_peft_model

    from unsloth.models.patches.moe import expert_target_parameters

    refuse_qat(kwargs.get("qat_scheme"))
    target_parameters = kwargs.pop("target_parameters", None) or []
    for name in sorted(set(kwargs) & (_ACCEPTED_UNUSED | {"finetune_last_n_layers"})):
        kwargs.pop(name)
    torch.manual_seed(random_state)
    # a string is a regex over module names (the vision loader's choice of towers), as in peft
    if not isinstance(target_modules, str):
        target_modules = _targets_peft_accepts(model, list(target_modules or DEFAULT_TARGETS))
        target_modules, modules_to_save = whole_modules.split_targets(target_modules, modules_to_save)
    if codec_of(model) is not None and kwargs.get("exclude_modules") is None:
        # a speech model's codec runs frozen under no_grad (CSM encodes audio with it): adapters there never learn
        kwargs["exclude_modules"] = CODEC_MODULES
    # packed MoE experts are parameters, not modules: peft adapts them through target_parameters
    target_parameters = list(dict.fromkeys([*target_parameters, *expert_target_parameters(model, target_modules)]))
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        bias=bias,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        layers_to_transform=layers_to_transform,
        layers_pattern=layers_pattern,
        use_rslora=use_rslora,
        modules_to_save=modules_to_save,
        init_lora_weights=init_lora_weights,
        loftq_config=loftq_config or {},
        task_type=task_type,
        **kwargs,
    )
    peft_model = get_peft_model(model, config)
    whole_modules.train_in_float32(peft_model)
    peft_model.max_seq_length = max_seq_length or getattr(model, "max_seq_length", None)
    peft_model._unsloth_checkpointing = use_gradient_checkpointing
    base = peft_model.get_base_model()
    layers = apply_gradient_checkpointing(base, use_gradient_checkpointing)
    _record_checkpointing(base, layers, use_gradient_checkpointing)
    patch_peft_model(peft_model)
    cheap_trainer_calls(peft_model)
    wanted = getattr(model, "_unsloth_offload_embedding", None)
    if wanted and world_size() > 1:
        log.warning("unsloth: offload_embedding: off in a job of several processes (DDP and FSDP keep "
                    "every weight on the rank's GPU).")
    if wanted is False:
        reason = "offload_embedding=False"
    elif world_size() > 1:
        reason = "a job of several processes"
    else:
        reason = offload_input_embedding(peft_model)
    if reason and wanted and world_size() == 1:
        log.warning("unsloth: offload_embedding: the input embedding stays on the GPU: %s.", reason)
    report = getattr(base, "_unsloth_patches", None)
    if report is not None:
        report.embedding = reason or "host memory"
    _say_what_is_fast(base)
    return peft_model


def _record_checkpointing(model, layers: int, mode) -> None:
    report = getattr(model, "_unsloth_patches", None)
    if report is not None:
        report.checkpointed, report.offloaded = layers, mode == "unsloth" and torch.cuda.is_available()


def _say_what_is_fast(model) -> None:
    """The load message: which parts of this model run through our code and which do not."""
    report = getattr(model, "_unsloth_patches", None)
    if report is not None:
        report.say()


def model_config(model):
    return model.get_base_model().config if hasattr(model, "get_base_model") else model.config
