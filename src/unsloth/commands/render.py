"""The one place command output is printed: a command's result (``unsloth.commands.results``) as text
for people, or as JSON with --json; and the echo that long or interactive work (a build, a streamed
reply, a chat) prints through while it runs.

``show`` is called by ``unsloth.cli.main`` with whatever a command's ``run`` returned and gives back
the exit code. Data goes to stdout; notes about it ("wrote ...", "repaired ...") go to stderr so a
pipe gets only the data. Errors are not shown here: ``unsloth.cli.report_error`` shows them.
"""

from __future__ import annotations

import json
import sys
from functools import singledispatch
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from unsloth.commands import results as r
from unsloth.doctor import render as doctor_render


def show(result: Any, as_json: bool = False) -> int:
    """Print ``result`` (text, or JSON when asked and the command has a JSON form); its exit code.

    A plain int is a command that printed as it went (through ``echo``) and has nothing more to say.
    """
    if isinstance(result, int):
        return result
    for note in getattr(result, "notes", ()):
        _note(note)
    if as_json:
        sys.stdout.write(json_text(result) + "\n")
    else:
        text(result)
    sys.stdout.flush()
    return int(result.exit_code)


def echo(message: str = "", *, err: bool = False, end: str = "\n") -> None:
    """Progress and interactive output, shown at once (a streamed reply, a note before work)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(message + end)
    stream.flush()


def progress_console() -> Console:
    """The console a long job (install, update, rollback, uninstall) reports its steps on; piped or
    captured, a line is never wrapped (paths unbroken, for logs and grep)."""
    return Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 1000)


def _note(message: str) -> None:
    print(message, file=sys.stderr)


# --- JSON ---------------------------------------------------------------------------------------

@singledispatch
def json_text(result: Any) -> str:
    raise TypeError(f"{type(result).__name__} has no JSON form")


@json_text.register
def _(result: r.PlatformReport) -> str:
    return json.dumps(result.platform.to_json(), indent=2, default=str)


@json_text.register
def _(result: r.DoctorReport) -> str:
    return json.dumps(result.report.to_json(), indent=2, default=str)


@json_text.register
def _(result: r.EnvListing) -> str:
    return json.dumps(result.rows, indent=2)


@json_text.register
def _(result: r.PlanReport) -> str:
    data = result.plan.to_json()
    if result.sources is not None:
        data["install_sources"] = result.sources.to_json()  # "sources" is the plan's citations
    return json.dumps(data, indent=2)


@json_text.register
def _(result: r.Exported) -> str:
    return json.dumps({"ok": result.ok, **result.result.to_json()}, indent=2)


@json_text.register
def _(result: r.Generated) -> str:
    return json.dumps({"ok": True, **result.generation.to_json()}, ensure_ascii=False)


# --- text ---------------------------------------------------------------------------------------

@singledispatch
def text(result: Any) -> None:
    raise TypeError(f"no renderer for {type(result).__name__}")


@text.register
def _(result: r.PlatformReport) -> None:
    doctor_render.print_platform(result.platform)


@text.register
def _(result: r.DoctorReport) -> None:
    out = doctor_render.console()
    if result.verbose:
        doctor_render.print_platform(result.platform, out)
    if result.from_dir is not None:
        out.print(f"Checking the dump in {result.from_dir} (live-only checks are skipped)")
    doctor_render.print_findings(result.report.findings, result.report.summary(), verbose=result.verbose, out=out)


@text.register
def _(result: r.EnvListing) -> None:
    if not result.rows:
        print(f"No environments under {result.home}.")
    for row in result.rows:
        mark = "*" if row["active"] else " "
        print(f"{mark} {row['name']}  {row['status']:<10} {row['backend'] or '-':<5} "
              f"torch {row['torch'] or '-':<14} {row['path']}")


@text.register
def _(result: r.EnvPath) -> None:
    print(result.path)


@text.register
def _(result: r.EnvLock) -> None:
    if result.output is None:
        sys.stdout.write(result.text)
    else:
        _note(f"Wrote {result.output} ({result.pinned} packages) from {result.env_name}.")


@text.register
def _(result: r.NoEnvironment) -> None:
    _note(f"unsloth env: no environment is installed under {result.home}; run `unsloth install` "
          "(or install.sh) first.")


@text.register
def _(result: r.Declined) -> None:
    progress_console().print("Nothing changed.")


# --- install, update, rollback, uninstall ---------------------------------------------------------
# On the console their progress went to (stdout), after it. Paths and tool output are not markup: pip's
# "[notice]" would vanish, a "[/path]" would raise.

def _exposure(console: Console, exposure: r.Exposure) -> None:
    for changed in exposure.path_added_to:
        console.print(escape(f"Added {exposure.bin_dir} to PATH in {changed}"))
    if not exposure.on_path:
        now = "" if exposure.windows else f' (or run: export PATH="{exposure.bin_dir}:$PATH")'  # Windows: the user PATH is set
        console.print(escape(f"Open a new terminal{now} to use `{exposure.launcher.name}`."))


def _kept(console: Console, kept: str | None) -> None:
    if kept:
        console.print(escape(f"Nothing changed: {kept} is still the active environment."))
    else:
        console.print("Nothing was installed; your system is as it was.")


@text.register
def _(result: r.Installed) -> None:
    console = progress_console()
    _exposure(console, result.exposure)
    console.print(f"[green]Ready[/]: environment {escape(result.env)} is active ({escape(result.backend)}).")
    if result.previous:
        console.print(escape(f"The previous one ({result.previous}) is kept: `unsloth rollback` returns to it."))


@text.register
def _(result: r.UpToDate) -> None:
    console = progress_console()
    _exposure(console, result.exposure)
    if result.newest:
        console.print(f"[green]Up to date[/]: {escape(result.env)} already has the newest versions for this plan.")
    else:
        console.print(f"[green]Up to date[/]: {escape(result.env)} already matches this plan "
                      f"({escape(result.backend)}). Nothing to do.")


@text.register
def _(result: r.BuildRefused) -> None:
    console = progress_console()
    if result.tail is not None:  # a step failed: its last output lines, and its log
        console.print(f"[red]✗ {escape(result.problem)}[/]\n{escape(result.tail)}\n")
        console.print(f"Full log: {escape(str(result.log))}  (that build was removed)")
    else:  # the environment was built and did not verify
        console.print(f"[red]✗ {escape(result.problem)}[/]")
        for problem in result.found:
            console.print(f"  - {escape(problem)}")
        console.print(f"Logs: {escape(str(result.log))}  (that build was removed)")
    console.print(f"Likely fix: {escape(result.fix)}")
    _kept(console, result.kept)


@text.register
def _(result: r.BuildInterrupted) -> None:
    console = progress_console()
    console.print("[yellow]Interrupted[/]: the half-built environment was removed.")
    _kept(console, result.kept)


@text.register
def _(result: r.RolledBack) -> None:
    print(f"Rolled back: {result.active} is active again (was {result.was}; `unsloth rollback` swaps back).")


@text.register
def _(result: r.NothingToRollBack) -> None:
    print("Nothing to roll back to: there is no previous environment.")


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GB" if n >= 1024**3 else f"{n / 1024**2:.0f} MB"


@text.register
def _(result: r.Uninstalled) -> None:
    # Plain print: this usually runs from the environment just deleted, so nothing may be imported now
    # (a rich console can import lazily).
    for path in result.removed:
        print(f"removing {path}")
    for changed in result.path_removed_from:
        print(f"removed the PATH line from {changed}")
    print("Uninstalled; your training outputs are kept.")
    for what, path, size in result.caches_kept:
        print(f"  kept {path} ({_size(size)}): {what}")


@text.register
def _(result: r.Trained) -> None:
    if result.full_finetuning:
        print(f"done: the fine-tuned model in {result.output_dir}")
        return
    print(f"done: adapters in {result.output_dir}/lora"
          + (f", merged model in {result.merged_dir}" if result.merged_dir else ""))


@text.register
def _(result: r.TrainInterrupted) -> None:
    _note(f"\nunsloth train: interrupted; checkpoints so far are kept in {result.output_dir} "
          "(add --resume to continue)")


@text.register
def _(result: r.DemoRun) -> None:
    pass  # the demo reported each step and its answers as it ran


@text.register
def _(result: r.Exported) -> None:
    export = result.result
    for method, report in export.validations.items():
        if method not in export.files:  # the unquantized reference, checked and then removed
            print(f"reference {method} (not kept)\n  {report.summary()}")
    for method, path in export.files.items():
        print(f"{path}  ({result.sizes.get(method, 0) / 1024**2:.1f} MiB)")
        if method in export.validations:
            print(f"  {export.validations[method].summary()}")
    if export.modelfile:
        print(f"{export.modelfile}  (ollama create NAME -f {export.modelfile})")
    first = next(iter(export.files.values()))
    print(f"try it: unsloth chat {first}" + (" --image PICTURE.png" if "mmproj" in export.files else ""))
    if not result.ok:
        _note("warning: a quantized file agrees with the 16-bit model less than expected; "
              "prefer a larger method (q8_0, q6_k)")


# --- the install plan ---------------------------------------------------------------------------

def advice(console: Console, warnings) -> None:
    # Messages quote GPU names and paths: plain text, never rich markup.
    for item in warnings:
        console.print(f"[yellow]![/] {escape(item.message)}" + (f"\n  fix: {escape(item.fix)}" if item.fix else ""))


def plan_summary(console: Console, plan) -> None:
    """The one line an install starts with: what it is about to build, and the plan's advice."""
    device = plan.device.name if plan.device else "CPU"
    console.print(f"Plan: [bold]{plan.support}[/] support on {escape(device)} — PyTorch {plan.torch.backend}"
                  f" ({plan.torch.variant}) from {escape(str(plan.torch.index_url))}")
    if plan.vllm is not None:
        console.print(f"  vLLM: {escape(vllm_row(plan.vllm))}")
    advice(console, plan.warnings)


def vllm_row(vllm) -> str:
    return f"{vllm.spec} from the package sources — {vllm.note}" if vllm.available else vllm.note


def fla_row(fla) -> str:
    return f"{fla.spec} — {fla.note}" if fla.available else fla.note


def plan_rows(plan) -> dict[str, str]:
    bnb, llama = plan.bitsandbytes, plan.llama_cpp
    how = f"prebuilt from {llama.index_url}" if llama.how == "wheel" else f"source build, CMAKE_ARGS={llama.cmake_args!r}"
    return {
        "support": f"{plan.support}: {plan.reason}",
        # device_reason already opens with the chosen GPU's label (name, arch, family).
        "device": plan.device_reason if plan.device else f"CPU — {plan.device_reason}",
        "torch": f"{plan.torch.backend} ({plan.torch.variant}) {plan.torch.version_spec or 'torch'} from {plan.torch.index_url}",
        "bitsandbytes": (bnb.spec or "none") + (f" — {bnb.note}" if bnb.note else ""),
        "llama.cpp": f"{llama.backend} — {how}",
        **({"flash-linear-attention": fla_row(plan.flash_linear_attention)}
           if plan.flash_linear_attention is not None else {}),
        **({"vllm": vllm_row(plan.vllm)} if plan.vllm is not None else {}),  # only when --with vllm asked
        "attention": plan.attention,
        "env": " ".join(f"{k}={v}" for k, v in plan.env.items()) or "-",
    }


@text.register
def _(result: r.PlanReport) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    rows = plan_rows(result.plan)
    sources = result.sources
    if sources is not None:  # what this machine's install will really use
        torch = result.plan.torch
        rows = {**{k: v for k, v in rows.items() if k in ("support", "device")},
                "packages": sources.packages_line(),
                **rows,
                "torch": f"{torch.backend} ({torch.variant}) {sources.torch_line()}",
                "llama.cpp": sources.llama_cpp.line() if sources.llama_cpp else "left out (--without)"}
    for name, value in rows.items():
        table.add_row(name, Text(value))
    # Piped or captured, each row stays one line (paths and URLs unbroken, for logs and grep); on a
    # terminal the table wraps to its width.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 1000)
    console.print(table)
    advice(console, result.plan.warnings)
