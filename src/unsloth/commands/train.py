"""`unsloth train CONFIG [--set key=value ...]` and `unsloth train --demo`."""

from __future__ import annotations

import argparse
import logging
import os

from unsloth.commands import render
from unsloth.commands.results import DemoRun, Trained, TrainInterrupted
from unsloth.errors import ExitCode, UnslothError, UsageError

# Common settings with their own flag; anything else goes through --set key.path=value.
_FLAGS = {
    "model": "model.name",
    "dataset": "dataset.name",
    "output_dir": "output_dir",
    "max_steps": "training.max_steps",
    "learning_rate": "training.learning_rate",
    "batch_size": "training.per_device_train_batch_size",
    "max_seq_length": "model.max_seq_length",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model from a TOML/YAML config (or --demo)",
        description="Fine-tune with LoRA/QLoRA from a TOML or YAML config; flags override the file. "
        "`unsloth train --demo` trains a tiny model on a built-in task, on any machine.",
    )
    p.add_argument("config", nargs="?", help="a .toml, .yaml or .yml training config")
    p.add_argument("--demo", nargs="?", const="capitals", default=None, metavar="NAME",
                   help="a built-in demo on a tiny model built here (CPU ok): capitals (the default), vision, dpo")
    p.add_argument("--model", help="model name or local folder (model.name)")
    p.add_argument("--dataset", help="hub dataset or local .jsonl/.parquet/.csv (dataset.name)")
    p.add_argument("--output-dir", dest="output_dir", help="where checkpoints and results go")
    p.add_argument("--max-steps", dest="max_steps", type=int, help="training.max_steps")
    p.add_argument("--learning-rate", dest="learning_rate", type=float, help="training.learning_rate")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="training.per_device_train_batch_size")
    p.add_argument("--max-seq-length", dest="max_seq_length", type=int, help="model.max_seq_length")
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="resume from the latest checkpoint in output_dir (or from the given checkpoint)")
    p.add_argument("--gpus", metavar="N",
                   help="train on N GPUs of this machine (or all), one process each, through torchrun")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any setting, e.g. --set training.warmup_steps=10 (repeatable)")
    p.set_defaults(func=run)


def _quiet_libraries() -> None:
    """Our own log lines at INFO; the libraries' deprecation notices and dataset-map bars stay out of the way.

    In a job of several processes only rank 0 logs; the others say only what went wrong.
    """
    import os
    import warnings

    main = int(os.environ.get("RANK", "0")) == 0
    log = logging.getLogger("unsloth")
    log.setLevel(logging.INFO if main else logging.ERROR)
    if not main:
        warnings.filterwarnings("ignore")
        try:
            from transformers.utils import logging as transformers_logging

            transformers_logging.set_verbosity_error()
            transformers_logging.disable_progress_bar()
        except ImportError:
            pass
    from unsloth.logs import log_handler, own_handlers

    if not own_handlers(log) and not logging.getLogger().handlers:
        log.addHandler(log_handler())
    warnings.filterwarnings("ignore", category=FutureWarning)
    # bitsandbytes' CPU backend suggests an optional package on import; irrelevant to training here.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def run(args: argparse.Namespace) -> int:
    _quiet_libraries()
    if args.demo:
        return _demo(args)
    if not args.config:
        raise UsageError("no config file given", "unsloth train my.toml, or try `unsloth train --demo`")
    from unsloth.training.config import load_config

    overrides = list(args.overrides)
    for flag, key in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    if args.resume is not None:
        overrides.append(f"resume={args.resume if isinstance(args.resume, str) else 'true'}")
    config = load_config(args.config, overrides)  # a ConfigError says what and how, before any work
    if args.gpus is not None and "LOCAL_RANK" not in os.environ:
        return _launch(args.gpus, config, [args.config, *(f"--set={item}" for item in overrides)])
    return _train(config)


def _launch(gpus: str, config, train_args: list[str]) -> int:
    import torch

    from unsloth.training.launch import CPU_PROCESSES_ENV, gpu_count, launch

    cpu_processes = os.environ.get(CPU_PROCESSES_ENV) == "1"
    count = gpu_count(gpus, torch.cuda.device_count(), cpu_processes=cpu_processes)
    if count == 1 and not cpu_processes:  # one GPU: no launcher needed
        return _train(config)
    from unsloth.training.sft import check_before_loading

    check_before_loading(config)  # the [training] mistakes, said once, before N processes start
    return launch(count, train_args, cpu_processes=cpu_processes)


def _train(config) -> Trained | TrainInterrupted | int:
    import torch

    from unsloth.training.memory import out_of_memory_advice
    from unsloth.training.sft import disk_full, remove_cut_checkpoints, train

    try:
        result = train(config, echo=render.echo)
    except torch.OutOfMemoryError as exc:
        batch = config.training.get("per_device_train_batch_size", 2)
        raise UnslothError("out of GPU memory",
                           out_of_memory_advice(batch, config.model.max_seq_length, config.model.load_in_4bit),
                           kept=f"checkpoints so far are kept in {config.output_dir} (add --resume to continue)",
                           exit_code=ExitCode.OUT_OF_MEMORY) from exc
    except KeyboardInterrupt:
        return TrainInterrupted(config.output_dir)
    except Exception as exc:
        if not disk_full(exc):
            raise
        # Nothing half-written stays under a checkpoint's name (rank 0 writes them, and tidies them).
        last = remove_cut_checkpoints(config.output_dir, render.echo if int(os.environ.get("RANK", "0")) == 0 else None)
        retry = (f"then add --resume to continue from {last.name}" if last else "then run the same command again")
        raise UnslothError(f"the disk filled up (or a file-size limit was reached) while writing to {config.output_dir}",
                           f"free space on that disk or choose another --output-dir, {retry}",
                           kept=f"the checkpoints written to the end are kept (the last: {last.name})" if last
                           else "no checkpoint was complete yet") from exc
    if int(os.environ.get("RANK", "0")) != 0:
        return ExitCode.OK  # rank 0 alone reports
    return Trained(result.output_dir, result.merged_dir, full_finetuning=config.model.full_finetuning)


def _demo(args: argparse.Namespace) -> DemoRun:
    from unsloth.training.demo import DEFAULT_OUTPUT, demos

    runners = demos()
    if args.demo not in runners:
        raise UsageError(f"--demo: no demo called {args.demo!r}",
                         "one of: " + ", ".join(sorted(runners)) + " (unsloth train --demo runs capitals)")
    kwargs = {"output_dir": args.output_dir or (DEFAULT_OUTPUT if args.demo == "capitals"
                                                else f"{DEFAULT_OUTPUT}-{args.demo}")}
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise UsageError(f"--max-steps must be 1 or more (got {args.max_steps})", "--max-steps 150 (the default)",
                             kept="nothing was trained")
        kwargs["max_steps"] = args.max_steps
    result = runners[args.demo](**kwargs, echo=render.echo)
    return DemoRun(list(result.losses))
