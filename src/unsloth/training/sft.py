"""Fine-tuning from a TrainConfig: FastLanguageModel + LoRA + TRL's SFTTrainer (or, for the preference
methods, its DPO / ORPO / KTO / CPO trainer: training/preference.py).

This is what `unsloth train CONFIG` and the demo run. The trainer is TRL's own; we add the
model, the dataset loading, a compact progress/loss log (also written to loss_log.jsonl),
checkpoints and resume (the Trainer's), and the saves at the end.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import re
import shutil
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from unsloth.training.config import ConfigError, DatasetConfig, TrainConfig, check_value
from unsloth.training.inputs import KEPT, check_data_file, check_data_folder, check_model
from unsloth.training.memory import check_before_training
from unsloth.training.optimizers import usable_optimizer

# Known local data files -> the `datasets` builder that reads them.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Dataset shapes TRL's SFTTrainer understands (one of these column sets must be present).
_SHAPES = ({"messages"}, {"prompt", "completion"}, {"text"})


@dataclass
class TrainResult:
    model: Any
    tokenizer: Any
    losses: list[float]
    output_dir: str
    merged_dir: str | None
    trainer: Any = None


def load_dataset_from(config: DatasetConfig, columns: tuple[str, ...] | None = None):
    """A hub dataset or a local jsonl / json / parquet / csv file, checked to be in a shape SFT reads
    (or, given `columns`, to have all of them: a preference method's)."""
    from datasets import load_dataset

    path = Path(config.name).expanduser()
    if path.suffix.lower() in _BUILDERS or path.exists():
        if not path.exists():
            raise ConfigError(f"dataset.name: {path} does not exist",
                              "a local .jsonl/.json/.parquet/.csv file, or a Hugging Face dataset name such as "
                              "'trl-lib/Capybara'", kept=KEPT)
        if path.is_dir():
            check_data_folder(path)
            data = _load_local(path, lambda: load_dataset(str(path), split=config.split))
        elif path.suffix.lower() not in _BUILDERS:
            raise ConfigError(f"dataset.name: {path.name}: unknown file type; use .jsonl, .json, .parquet or .csv")
        else:
            check_data_file(path)
            data = _load_local(path, lambda: load_dataset(_BUILDERS[path.suffix.lower()], data_files=str(path),
                                                          split="train"))
        if len(data) == 0:
            raise ConfigError(f"dataset.name: {path} holds no rows", "add training examples", kept=KEPT)
    else:
        try:
            data = load_dataset(config.name, config.subset, split=config.split)
        except Exception as exc:  # not found, offline, gated, bad split: `datasets` raises many kinds
            raise ConfigError(f"dataset.name: could not load {config.name!r} from the Hugging Face hub "
                              f"({type(exc).__name__}: {exc}); give a local .jsonl/.json/.parquet/.csv "
                              "file or a hub dataset name") from None
    if config.limit is not None:
        data = data.select(range(min(config.limit, len(data))))
    if config.text_field and config.text_field != "text":
        if config.text_field not in data.column_names:
            raise ConfigError(f"dataset.text_field: no column {config.text_field!r}; "
                              f"columns are {', '.join(data.column_names)}")
        data = data.rename_column(config.text_field, "text")
    if columns is not None:
        missing = [c for c in columns if c not in data.column_names]
        if missing:
            raise ConfigError(f"dataset {config.name}: missing column(s) {', '.join(repr(c) for c in missing)} "
                              f"(it has {', '.join(data.column_names)}); this method needs "
                              f"{', '.join(columns)}", "rename the columns in the data (or choose another method)",
                              kept=KEPT)
        return data
    columns = set(data.column_names)
    if not any(shape <= columns for shape in _SHAPES):
        raise ConfigError(f"dataset {config.name}: columns {sorted(columns)} are none of the shapes SFT reads: "
                          "'messages' (chat), 'prompt' + 'completion', or 'text' (set dataset.text_field "
                          "to use another text column)")
    return data


def _load_local(path: Path, load: Callable[[], Any]):
    """``load()``, with what `datasets` still refuses after our checks (mixed column types, ...) named by file."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - `datasets` raises many kinds; the user needs the file and the reason
        reason = str(getattr(exc, "__cause__", None) or exc).splitlines()[0][:300]
        raise ConfigError(f"dataset.name: `datasets` could not read {path} ({type(exc).__name__}: {reason})",
                          "make every row the same shape (the same keys, with values of the same types)",
                          kept=KEPT) from exc


def check_before_loading(config: TrainConfig) -> None:
    """The mistakes that need no model: caught before minutes of loading, not after."""
    check_model(config.model)  # a local folder: config.json, model_type, weights
    sft_arguments(config, bf16=False, fp16=False)  # the [training] keys and values
    complete = [p for p in _checkpoints(config.output_dir) if complete_checkpoint(p)]
    if config.resume is True and not complete:
        cut = "" if not _checkpoints(config.output_dir) else " (only ones cut off while being written)"
        raise ConfigError(f"resume: no complete checkpoint-* folder in {config.output_dir} to resume from{cut}; "
                          "set resume = false to start over")
    if isinstance(config.resume, str) and not complete_checkpoint(Path(config.resume)):
        found = ", ".join(str(p) for p in complete) or f"none in {config.output_dir}"
        raise ConfigError(f"resume: {config.resume} is not a checkpoint folder (checkpoint-N, with "
                          f"its weights and trainer_state.json, written to the end); checkpoints: {found}")


def sft_arguments(config: TrainConfig, bf16: bool, fp16: bool):
    """The method's TRL config (SFTConfig, DPOConfig, ...) from our defaults plus [training]; unknown keys
    are named with a suggestion."""
    from unsloth.training import preference

    if config.method == "sft":
        from trl import SFTConfig
    else:
        SFTConfig = preference.config_class(config.method)  # noqa: N806 - a class
    name = SFTConfig.__name__
    hints = typing.get_type_hints(SFTConfig)
    known = [f.name for f in dataclasses.fields(SFTConfig)]
    for key, value in config.training.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (see TRL's {name} for the fields)"
            of = "" if config.method == "sft" else f" of method {config.method!r}"
            raise ConfigError(f"training.{key}: not a training argument{of}{hint}")
        check_value(hints[key], value, f"training.{key}")  # only checked: the Trainer gets the value as given
    arguments = {
        "output_dir": config.output_dir,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 2e-4,
        "logging_steps": 1,
        "max_length": config.model.max_seq_length,
        "report_to": "none",
        "seed": config.seed,
        "bf16": bf16,
        "fp16": fp16,
        # Checkpointing is ours (per layer, offloaded); the Trainer's would recompute twice.
        "gradient_checkpointing": False,
        # Under DDP: every trainable weight gets a gradient each step, so the per-step search of the
        # graph for unused ones (the Trainer's default for a PeftModel) is skipped.
        "ddp_find_unused_parameters": False,
        "dataloader_pin_memory": _on_gpu(),
        # Packing (best-fit decreasing) is padding-free: sequences share a row, positions restart per sequence.
        "packing": config.packing,
    }
    if config.method != "sft":
        del arguments["packing"]
        arguments.update(preference.DEFAULTS[config.method])
    arguments.update(config.training)
    if "optim" in arguments:
        arguments["optim"] = usable_optimizer(arguments["optim"], "training.optim")
    try:
        return SFTConfig(**arguments)
    except (TypeError, ValueError) as exc:  # a value of the wrong kind, or settings that do not go together
        raise ConfigError(f"training: TRL's {name} refuses these settings: {exc}") from None


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _callbacks(output_dir: str, echo: Callable[[str], None], losses: list[float]):
    from transformers.trainer_callback import ProgressCallback

    class Progress(ProgressCallback):
        """The Trainer's progress bar, with one compact line per log instead of a dict, and loss_log.jsonl."""

        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            # The log continues the run being trained: a fresh run starts it over, and a resumed one
            # drops what was logged after its checkpoint (those steps run again).
            log = Path(output_dir) / "loss_log.jsonl"
            if state.is_world_process_zero and log.is_file():
                kept = [line for line in log.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= state.global_step]
                log.write_text("".join(line + "\n" for line in kept))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            if "loss" in logs:
                losses.append(float(logs["loss"]))
            record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(output_dir) / "loss_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if "loss" in logs:
                line = f"step {state.global_step}/{state.max_steps}  loss {logs['loss']:.4f}"
                if "learning_rate" in logs:
                    line += f"  lr {logs['learning_rate']:.2e}"
                if self.training_bar is not None:
                    self.training_bar.write(line)
                else:
                    echo(line)

    return Progress


def load_model(config: TrainConfig):
    """The model (with LoRA unless full fine-tuning) and tokenizer a config asks for."""
    from unsloth.models.loader import add_lora, load_pretrained

    m = config.model
    try:
        model, tokenizer = load_pretrained(
            m.name, max_seq_length=m.max_seq_length, dtype=m.dtype, load_in_4bit=m.load_in_4bit,
            load_in_8bit=m.load_in_8bit, full_finetuning=m.full_finetuning, trust_remote_code=m.trust_remote_code,
            revision=m.revision, use_gradient_checkpointing=config.gradient_checkpointing, random_state=config.seed,
        )
    except OSError as exc:  # transformers' "not found / not a valid repo id / offline" errors
        raise ConfigError(f"model.name: could not load {m.name!r}: {exc}\n  fix: a local model folder "
                          "(with config.json) or a Hugging Face model name") from None
    if m.chat_template:
        tokenizer.chat_template = m.chat_template
    if not m.full_finetuning:
        lora = config.lora
        model = add_lora(
            model, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
            bias=lora.bias, use_rslora=lora.use_rslora, use_gradient_checkpointing=config.gradient_checkpointing,
            random_state=config.seed,
        )
    return model, tokenizer


def train(config: TrainConfig, echo: Callable[[str], None] = print, callbacks=()) -> TrainResult:
    """Run supervised fine-tuning as configured; returns the trained model, tokenizer and loss log."""
    import torch
    from trl import SFTTrainer
    from transformers.trainer_callback import ProgressCallback

    from unsloth.training import preference

    check_before_loading(config)
    columns = None if config.method == "sft" else preference.METHODS[config.method][2]
    dataset = load_dataset_from(config.dataset, columns)
    model, tokenizer = load_model(config)
    if ("messages" in dataset.column_names or "prompt" in dataset.column_names) and not tokenizer.chat_template \
            and isinstance(dataset[0].get("messages", dataset[0].get("prompt")), list):
        raise ConfigError(f"model {config.model.name}: its tokenizer has no chat template, and the dataset is "
                          "chat-shaped; set model.chat_template to a Jinja template")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    quantization = getattr(model.config, "quantization_config", None)
    four_bit = getattr(quantization, "load_in_4bit", False)  # an 8-bit config's compute dtype is unused
    compute = (getattr(quantization, "bnb_4bit_compute_dtype", None) if four_bit else None) or dtype
    args = sft_arguments(config, bf16=compute == torch.bfloat16, fp16=compute == torch.float16)
    losses: list[float] = []
    trainer_cls = SFTTrainer if config.method == "sft" else preference.trainer_class(config.method)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=list(callbacks))
    if not getattr(trainer, "checks_memory", False):  # the notebook trainers' train() checks it itself
        check_before_training(model, batch=args.per_device_train_batch_size, seq=config.model.max_seq_length,
                              optim=args.optim, checkpointing=config.gradient_checkpointing,
                              full_finetuning=config.model.full_finetuning,
                              load_in_4bit=config.model.load_in_4bit, echo=echo)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_callbacks(config.output_dir, echo, losses))
    trainer.train(resume_from_checkpoint=resume_point(config, echo))
    model = trainer.model
    merged_dir = _save(model, tokenizer, trainer, config)
    return TrainResult(model, tokenizer, losses, config.output_dir, merged_dir, trainer)


def _checkpoints(output_dir: str) -> list[Path]:
    """checkpoint-N folders, oldest step first (checkpoint-10 after checkpoint-9)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name.partition("-")[2].isdigit()]
    return sorted(found, key=lambda p: int(p.name.partition("-")[2]))


# One of these holds a checkpoint's weights (LoRA adapters, or a full model, sharded or not).
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
            "pytorch_model.bin")


def complete_checkpoint(folder: Path) -> bool:
    """Written to the end: the Trainer writes trainer_state.json last, so a run killed while saving
    leaves a folder without it, or with it cut short (not JSON, or another step's)."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(state, dict) and str(state.get("global_step")) == folder.name.partition("-")[2]
            and any((folder / name).is_file() for name in _WEIGHTS))


def resume_point(config: TrainConfig, echo: Callable[[str], None]) -> str | None:
    """The checkpoint to resume from: the one asked for, or the last complete one. Newer folders
    that a stopped run left half-written are removed, so the Trainer never reads or rotates them."""
    if not config.resume:
        return None
    if isinstance(config.resume, str):
        return config.resume
    last = remove_cut_checkpoints(config.output_dir, echo)  # one exists: checked before loading
    echo(f"resuming from {last}")
    return str(last)


def remove_cut_checkpoints(output_dir: str, echo: Callable[[str], None] | None) -> Path | None:
    """Remove the checkpoint folders newer than the last complete one (a stopped run, or a full disk,
    cut them off while they were written); that last complete one, or None. ``echo`` None: only find it
    (another process than the one that writes checkpoints)."""
    folders = _checkpoints(output_dir)
    complete = [i for i, folder in enumerate(folders) if complete_checkpoint(folder)]
    last = complete[-1] if complete else -1
    for cut in folders[last + 1:] if echo is not None else ():
        shutil.rmtree(cut)
        echo(f"removed {cut.name}: the run stopped while writing it")
    return folders[last] if complete else None


# A write the disk refused, as each writer says it: an OSError's errno (ENOSPC, EDQUOT, EFBIG), or the
# text of safetensors' ("I/O error: ... (os error 28)") and torch.save's errors, which carry none.
_DISK_FULL = re.compile(r"\(os error (28|27|122)\)|No space left on device|File too large|Disk quota exceeded|"
                        r"file write failed|requested and \d+ written")


def disk_full(exc: BaseException) -> bool:
    """Did ``exc`` come from the disk filling up (or a file-size limit) while something was written?"""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    return any(_DISK_FULL.search(str(link)) for link in (exc, exc.__cause__, exc.__context__) if link is not None)


def _save(model, tokenizer, trainer, config: TrainConfig) -> str | None:
    from unsloth.models.distributed import is_main_process

    output = Path(config.output_dir)
    if not is_main_process():  # data parallel: every rank holds the same weights; rank 0 writes them
        return None
    if config.model.full_finetuning:
        trainer.save_model(str(output))
        tokenizer.save_pretrained(str(output))
        return str(output)
    model.save_pretrained(str(output / "lora"))
    tokenizer.save_pretrained(str(output / "lora"))
    if config.save_merged:
        from unsloth.export.merged import save_pretrained_merged

        return save_pretrained_merged(model, str(output / "merged"), tokenizer)
    return None
