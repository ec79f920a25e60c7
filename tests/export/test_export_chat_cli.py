"""`unsloth chat` and `unsloth generate` on a small GGUF, and the Modelfile's prompt format."""

from __future__ import annotations

import builtins
import io
import json

import pytest

from export_models import make_model, make_tokenizer


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from unsloth.export.gguf import save_pretrained_gguf

    out = tmp_path_factory.mktemp("chat")
    result = save_pretrained_gguf(make_model("llama"), out, make_tokenizer(), "f16", validate_export=False)
    return result.files["f16"]


def test_generate_is_repeatable_and_json(gguf_file, capsys):
    from unsloth.cli import main

    runs = []
    for _ in range(2):
        assert main(["generate", str(gguf_file), "Hello", "--max-tokens", "6", "--json", "--cpu"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["text"] == runs[1]["text"]  # greedy by default
    assert runs[0]["completion_tokens"] == 6 and runs[0]["model"] == str(gguf_file)


def test_generate_streams_raw_prompt_from_stdin_and_a_directory(gguf_file, capsys, monkeypatch):
    from unsloth.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    assert main(["generate", str(gguf_file.parent), "-", "--raw", "--max-tokens", "5", "--cpu"]) == 0
    streamed = capsys.readouterr().out
    assert main(["generate", str(gguf_file), "Once upon a time", "--raw", "--max-tokens", "5", "--json", "--cpu"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert streamed == as_json["text"] + "\n"
    assert as_json["prompt_tokens"] == len(make_tokenizer()("Once upon a time")["input_ids"])  # no template


def test_generate_on_a_missing_file(tmp_path, capsys):
    from unsloth.cli import main

    assert main(["generate", str(tmp_path), "hi", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "holds no .gguf file" in report["error"] and "unsloth export" in report["fix"]


def test_generate_names_a_prompt_longer_than_the_context(gguf_file, capsys):
    from unsloth.cli import main

    prompt = "Once upon a time " * 200
    assert main(["generate", str(gguf_file), prompt, "--raw", "--n-ctx", "64", "--json", "--cpu"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "exceed context window" in report["error"] and "--n-ctx" in report["fix"]


def _typed(lines):
    """A stand-in for input(): the given lines, then Ctrl-D."""
    lines = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    return fake_input


def test_chat_keeps_the_conversation_and_resets(gguf_file, capsys, monkeypatch):
    from unsloth.cli import main
    from unsloth.export import chat

    seen = []
    original = chat.chat_stream
    monkeypatch.setattr(builtins, "input", _typed(["hello", "again", "/reset", "hello"]))
    monkeypatch.setattr(chat, "chat_stream", lambda llm, messages, **kw: (seen.append(list(messages)), original(llm, messages, **kw))[1])
    assert main(["chat", str(gguf_file), "--max-tokens", "4", "--temperature", "0", "--cpu"]) == 0
    replies = capsys.readouterr().out.splitlines()
    assert [len(m) for m in seen] == [1, 3, 1]  # the second turn sees the first; /reset forgets it
    assert replies[0] == replies[2]  # same prompt after a reset, greedy: same reply


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(gguf_file, capsys, monkeypatch):
    from unsloth.cli import main
    from unsloth.export import chat

    seen = []

    def interrupted(llm, messages, **kw):
        seen.append(list(messages))
        yield {"text": "par", "finish_reason": None}
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", _typed(["hello", "again"]))
    monkeypatch.setattr(chat, "chat_stream", interrupted)
    assert main(["chat", str(gguf_file), "--cpu"]) == 0
    assert "(stopped)" in capsys.readouterr().err
    assert seen[1][1] == {"role": "assistant", "content": "par"}  # the partial reply stays in the conversation


def test_modelfile_template_variants():
    from unsloth.export.modelfile import render_modelfile

    tokenizer = make_tokenizer()
    text = render_modelfile("m.gguf", tokenizer)
    assert text.startswith("FROM ./m.gguf\n")
    assert '{{ else if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n' in text
    assert text.count('PARAMETER stop "') == 2  # <|im_end|> and the eos token

    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template  # BOS once, at the start
    text = render_modelfile("m.gguf", tokenizer)
    assert "<|bos|>" not in text.split("TEMPLATE")[1].split('"""')[1]  # llama.cpp adds BOS itself

    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    text = render_modelfile("m.gguf", tokenizer)
    assert '"system"' not in text and '{{ if eq .Role "user" }}[user]{{ .Content }}</s>' in text

    tokenizer.chat_template = None
    assert render_modelfile("m.gguf", tokenizer) == 'FROM ./m.gguf\n\nPARAMETER stop "<|eos|>"\n'


def test_chat_sends_the_whole_conversation_through_the_template_each_turn(gguf_file, capsys, monkeypatch):
    """Two turns on standard input: the second turn's prompt, as llama.cpp evaluated it, is the file's
    chat template over the first question, its reply and the second question."""
    from jinja2 import Template

    from unsloth.cli import main
    from unsloth.export import chat

    turns = []
    original = chat.chat_stream

    def recording(llm, messages, **kw):
        yield from original(llm, messages, **kw)
        turns.append((list(messages), list(llm._input_ids)))  # what llama.cpp holds after this reply

    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n"))
    monkeypatch.setattr(chat, "chat_stream", recording)
    assert main(["chat", str(gguf_file), "--max-tokens", "4", "--temperature", "0", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert len(turns) == 2
    (first, _), (second, evaluated) = turns
    reply = second[1]["content"]
    assert out.startswith(f"> {reply}\n> ")  # input()'s prompt, then the streamed reply
    assert second == [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": reply},
                      {"role": "user", "content": "and again"}]
    prompt = Template(make_tokenizer().chat_template).render(messages=second, add_generation_prompt=True)
    from llama_cpp import Llama

    vocab_only = Llama(str(gguf_file), vocab_only=True, verbose=False)
    expected = vocab_only.tokenize(prompt.encode(), add_bos=False, special=True)
    assert evaluated[:len(expected)] == expected  # then the second reply's tokens
