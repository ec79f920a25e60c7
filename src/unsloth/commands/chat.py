"""`unsloth chat MODEL` (interactive, streaming) and `unsloth generate MODEL PROMPT` (one-shot, --json).

Both run a GGUF through llama-cpp-python, on the GPU backend it was built for (CUDA, HIP, Vulkan)
or the CPU, and use the chat template stored in the file.
"""

from __future__ import annotations

import argparse
import json
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a .gguf file, or a directory written by `unsloth export` holding one")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per reply (default 256)")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--system", help="a system message")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length in tokens (default 4096, at most the trained length)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if llama.cpp was built for a GPU")
    p.add_argument("--image", metavar="PATH", help="an image for a vision-language model (not supported yet)")


def _refuse_image(args: argparse.Namespace) -> None:
    """Images need a GGUF with llama.cpp's projector file (mmproj), which our export does not write yet."""
    if getattr(args, "image", None):
        from unsloth.export import ExportError

        raise ExportError("chat with an image needs the vision model's GGUF projector file (mmproj), which "
                          "`unsloth export` does not write yet; nothing was run",
                          fix="chat with the merged model in Python: FastVisionModel.for_inference(model), then "
                          "model.generate(**processor(image, text, return_tensors='pt'))")


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


def run_generate(args: argparse.Namespace) -> int:
    from unsloth.export import ExportError
    from unsloth.export.chat import generate, open_model, stream

    _refuse_image(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm, path = open_model(args.model, n_ctx=args.n_ctx, gpu=not args.cpu)  # a bad file: an ExportError
    try:
        if args.json:
            result = generate(llm, path, prompt, raw=args.raw, system=args.system, **_sampling(args))
            print(json.dumps({"ok": True, **result.to_json()}, ensure_ascii=False))
        else:
            for chunk in stream(llm, prompt, raw=args.raw, system=args.system, **_sampling(args)):
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            sys.stdout.write("\n")
    except ValueError as exc:  # llama-cpp-python: the prompt does not fit the context
        raise ExportError(str(exc), fix="shorten the prompt or --max-tokens, or raise --n-ctx "
                          "(at most the model's trained length)") from exc
    finally:
        llm.close()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from unsloth.export.chat import chat_stream, has_chat_template, open_model

    _refuse_image(args)
    llm, path = open_model(args.model, n_ctx=args.n_ctx, gpu=not args.cpu)  # a bad file: an ExportError
    if not has_chat_template(llm):
        print(f"note: {path} has no chat template; llama-cpp-python falls back to a generic one", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"chatting with {path} (/reset clears, /exit or Ctrl-D quits)", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
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
                    sys.stdout.write(chunk["text"])
                    sys.stdout.flush()
            except ValueError as exc:  # llama-cpp-python: the conversation outgrew the context
                messages.pop()
                print(f"\n{exc}; /reset the conversation or restart with a larger --n-ctx", file=sys.stderr)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat (Ctrl-D or /exit quits)
                print("\n(stopped)", file=sys.stderr)
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        llm.close()
