"""`unsloth chat MODEL` (interactive, streaming) and `unsloth generate MODEL PROMPT` (one-shot, --json).

Both run a GGUF through llama-cpp-python, on the GPU backend it was built for (CUDA, HIP, Vulkan)
or the CPU, and use the chat template stored in the file.
"""

from __future__ import annotations

import argparse
import sys

from unsloth.commands import render
from unsloth.commands.results import Generated
from unsloth.errors import ExitCode


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file, or a directory written by `unsloth export` holding one")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per reply (default 256)")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--system", help="a system message")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length in tokens (default 4096, at most the trained length)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if llama.cpp was built for a GPU")


def register(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat", help="chat with an exported GGUF model (llama.cpp)",
        description="Interactive chat with a GGUF model through llama.cpp, streaming, with the "
        "model's chat template. /reset clears the conversation; Ctrl-C stops a reply; /exit or Ctrl-D quits.",
    )
    _common(chat)
    chat.set_defaults(func=run_chat, temperature_default=0.7)

    gen = subparsers.add_parser(
        "generate", help="one-shot generation from a GGUF model (scriptable, --json)",
        description="Generate a reply to PROMPT with a GGUF model through llama.cpp. The chat "
        "template is applied unless --raw. Greedy by default, so output is repeatable.",
    )
    _common(gen)
    gen.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    gen.add_argument("--raw", action="store_true", help="send PROMPT as-is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, finish reason, token counts, timing")
    gen.set_defaults(func=run_generate, temperature_default=0.0)


def _sampling(args: argparse.Namespace) -> dict:
    temperature = args.temperature if args.temperature is not None else args.temperature_default
    return {"max_tokens": args.max_tokens, "temperature": temperature, "top_p": args.top_p, "seed": args.seed}


def run_generate(args: argparse.Namespace) -> Generated | int:
    from unsloth.export import ExportError
    from unsloth.export.chat import generate, open_model, stream

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm, path = open_model(args.model, n_ctx=args.n_ctx, gpu=not args.cpu)  # a bad file: an ExportError
    try:
        if args.json:
            return Generated(generate(llm, path, prompt, raw=args.raw, system=args.system, **_sampling(args)))
        for chunk in stream(llm, prompt, raw=args.raw, system=args.system, **_sampling(args)):
            render.echo(chunk["text"], end="")
        render.echo()
    except ValueError as exc:  # llama-cpp-python: the prompt does not fit the context
        raise ExportError(str(exc), fix="shorten the prompt or --max-tokens, or raise --n-ctx "
                          "(at most the model's trained length)") from exc
    finally:
        llm.close()
    return ExitCode.OK


def run_chat(args: argparse.Namespace) -> int:
    """Interactive: each reply is streamed through the renderer's echo as it comes."""
    from unsloth.export.chat import chat_stream, has_chat_template, open_model

    llm, path = open_model(args.model, n_ctx=args.n_ctx, gpu=not args.cpu)  # a bad file: an ExportError
    if not has_chat_template(llm):
        render.echo(f"note: {path} has no chat template; llama-cpp-python falls back to a generic one", err=True)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    render.echo(f"chatting with {path} (/reset clears, /exit or Ctrl-D quits)", err=True)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                render.echo(err=True)
                return ExitCode.OK
            if line.strip() in ("/exit", "/quit"):
                return ExitCode.OK
            if line.strip() == "/reset":
                messages = list(system)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = []
            try:
                for chunk in chat_stream(llm, messages, **_sampling(args)):
                    reply.append(chunk["text"])
                    render.echo(chunk["text"], end="")
            except ValueError as exc:  # llama-cpp-python: the conversation outgrew the context
                messages.pop()
                render.echo(f"\n{exc}; /reset the conversation or restart with a larger --n-ctx", err=True)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat (Ctrl-D or /exit quits)
                render.echo("\n(stopped)", err=True)
            render.echo()
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        llm.close()
