"""`unsloth chat MODEL` (interactive, streaming) and `unsloth generate MODEL PROMPT` (one-shot, --json).

MODEL is a GGUF, run through llama-cpp-python on the GPU backend it was built for (CUDA, HIP, Vulkan)
or the CPU with the chat template stored in the file; or a checkpoint directory not exported yet (a
merged model, LoRA adapters, or what `unsloth train` wrote), run through transformers with our
kernels and fast generation path, with its tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import sys

from unsloth.commands import render
from unsloth.commands.results import Generated
from unsloth.errors import ExitCode


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file or a directory holding one (`unsloth export`), or a checkpoint "
                   "directory: a merged model, LoRA adapters, or the output of `unsloth train`")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per reply (default 256)")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--system", help="a system message")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length in tokens (default 4096, at most the trained length)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is there")
    p.add_argument("--load-in-4bit", action="store_true", help="a checkpoint directory: load its weights in 4-bit "
                   "(NF4, bitsandbytes) to fit a smaller GPU")
    p.add_argument("--image", metavar="PATH", help="an image (PNG, JPEG, ...) for a vision-language model's GGUF "
                   "with its projector file (mmproj-*.gguf) beside it; it goes with the first message")


def _check_image(args: argparse.Namespace) -> None:
    """--image: a readable file, a GGUF export (its projector file is found when it is opened), a chat template."""
    image = getattr(args, "image", None)
    if not image:
        return
    from pathlib import Path

    from unsloth.export import ExportError
    from unsloth.export.checkpoint_chat import is_checkpoint

    if not Path(image).is_file():
        raise ExportError(f"--image {image}: no such file", fix="pass the path of a PNG, JPEG or WebP image")
    path = Path(args.model)
    if path.is_dir() and not any(path.glob("*.gguf")) and is_checkpoint(path):
        raise ExportError(f"--image runs on a GGUF export with its projector file; {path} is a checkpoint folder",
                          fix=f"export it first (`unsloth export {path} --gguf q8_0 --out DIR`), then "
                          "`unsloth chat DIR --image PATH`; in Python: FastVisionModel.for_inference(model), then "
                          "model.generate(**processor(image, text, return_tensors='pt'))")
    if getattr(args, "raw", False):
        raise ExportError("--image goes into the chat template, and --raw sends the prompt without it",
                          fix="drop --raw")


def register(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat", help="chat with a GGUF (llama.cpp) or a checkpoint directory",
        description="Interactive chat with a GGUF model through llama.cpp, or with a checkpoint "
        "directory through our fast generation path, streaming, with the model's chat template. /reset clears the conversation; Ctrl-C stops a reply; /exit or Ctrl-D quits.",
    )
    _common(chat)
    chat.set_defaults(func=run_chat, temperature_default=0.7)

    gen = subparsers.add_parser(
        "generate", help="one-shot generation from a GGUF or a checkpoint directory (scriptable, --json)",
        description="Generate a reply to PROMPT with a GGUF model (llama.cpp) or a checkpoint directory. The chat "
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


class _Gguf:
    """A GGUF through llama.cpp, with the calls a CheckpointChat has."""

    def __init__(self, llm, path: str):
        self.llm, self.path = llm, path

    def has_chat_template(self) -> bool:
        from unsloth.export.chat import has_chat_template

        return has_chat_template(self.llm)

    def generate(self, prompt, **kw):
        from unsloth.export.chat import generate

        return generate(self.llm, self.path, prompt, **kw)

    def stream(self, prompt, **kw):
        from unsloth.export.chat import stream

        return stream(self.llm, prompt, **kw)

    def chat_stream(self, messages, **kw):
        from unsloth.export.chat import chat_stream

        return chat_stream(self.llm, messages, **kw)

    def close(self) -> None:
        self.llm.close()


def _open(args: argparse.Namespace):
    """A checkpoint directory on our generation path, anything else as a GGUF (a bad file: an ExportError)."""
    from pathlib import Path

    from unsloth.export.checkpoint_chat import is_checkpoint, open_checkpoint

    path = Path(args.model)
    if path.is_dir() and not any(path.glob("*.gguf")) and is_checkpoint(path):
        return open_checkpoint(path, n_ctx=args.n_ctx, gpu=not args.cpu, load_in_4bit=args.load_in_4bit)
    from unsloth.export.chat import open_model

    return _Gguf(*open_model(args.model, n_ctx=args.n_ctx, gpu=not args.cpu, image=bool(getattr(args, "image", None))))


def run_generate(args: argparse.Namespace) -> Generated | int:
    from contextlib import closing

    from unsloth.export import ExportError

    _check_image(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = _open(args)
    image = {"image": args.image} if args.image else {}
    try:
        if args.json:
            return Generated(model.generate(prompt, raw=args.raw, system=args.system, **image, **_sampling(args)))
        with closing(model.stream(prompt, raw=args.raw, system=args.system, **image, **_sampling(args))) as chunks:
            for chunk in chunks:
                render.echo(chunk["text"], end="")
        render.echo()
    except ValueError as exc:  # the prompt does not fit the context
        raise ExportError(str(exc), fix="shorten the prompt or --max-tokens, or raise --n-ctx "
                          "(at most the model's trained length)") from exc
    finally:
        model.close()
    return ExitCode.OK


def run_chat(args: argparse.Namespace) -> int:
    """Interactive: each reply is streamed through the renderer's echo as it comes."""
    from contextlib import closing

    _check_image(args)
    model = _open(args)
    path = model.path
    if not model.has_chat_template():
        if not isinstance(model, _Gguf):
            model.close()
            from unsloth.export import ExportError

            raise ExportError(f"{path}: its tokenizer has no chat template, so a conversation cannot be written "
                              "for it", fix=f"use `unsloth generate {args.model} PROMPT --raw`, or save the "
                              "tokenizer with a chat template (get_chat_template) next to the model")
        render.echo(f"note: {path} has no chat template; llama-cpp-python falls back to a generic one", err=True)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    about = f", about {args.image}" if args.image else ""
    render.echo(f"chatting with {path}{about} (/reset clears, /exit or Ctrl-D quits)", err=True)
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
            if args.image and not any(m["role"] == "user" for m in messages):  # the image goes with the first turn
                from unsloth.export.chat import messages_for

                messages.append(messages_for(line, image=args.image)[-1])
            else:
                messages.append({"role": "user", "content": line})
            reply = []
            try:
                with closing(model.chat_stream(messages, **_sampling(args))) as chunks:
                    for chunk in chunks:
                        reply.append(chunk["text"])
                        render.echo(chunk["text"], end="")
            except ValueError as exc:  # the conversation outgrew the context
                messages.pop()
                render.echo(f"\n{exc}; /reset the conversation or restart with a larger --n-ctx", err=True)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat (Ctrl-D or /exit quits)
                render.echo("\n(stopped)", err=True)
            render.echo()
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        model.close()
