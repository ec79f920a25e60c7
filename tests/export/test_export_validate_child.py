"""llama.cpp's side of validation runs in a child process: llama.cpp aborting on a file, or hanging,
is one clear error naming the file, how the child ended, its last output and the fix; the file is
kept, this process and its model live on; and a child that succeeds gives what llama.cpp gives here."""

from __future__ import annotations

import shutil
import sys
import textwrap

import numpy as np
import psutil
import pytest
import torch

from export_models import make_model
from unsloth.export import ExportError, runtime, validate_child
from unsloth.export.gguf import save_pretrained_gguf
from unsloth.export.validate import TOKENIZER_SAMPLES, reference_run, validate
from unsloth.export.validate_child import ValidationCrashed


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.fixture(scope="module")
def reference(model, tokenizer):
    return reference_run(model, tokenizer)


@pytest.fixture(scope="module")
def f16(model, tokenizer, tmp_path_factory):
    return save_pretrained_gguf(model, tmp_path_factory.mktemp("gguf"), tokenizer, "f16", validate_export=False).files["f16"]


def duplicate_a_token(path):
    """Give one token the text of another (same length, so in place): llama.cpp's vocab loader then
    fails GGML_ASSERT(id_to_token.size() == token_to_id.size()) and aborts."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["tokenizer.ggml.tokens"]
    texts = [bytes(field.parts[i]) for i in field.data]
    first = {}
    for index, text in enumerate(texts):
        if len(text) in first:
            field.parts[field.data[index]][:] = np.frombuffer(texts[first[len(text)]], dtype=np.uint8)
            break
        first[len(text)] = index
    reader.data.flush()


def test_an_abort_inside_llama_cpp_is_one_clear_error_and_this_process_lives(tmp_path, f16, reference, tokenizer):
    bad = tmp_path / "bad.gguf"
    shutil.copy(f16, bad)
    duplicate_a_token(bad)
    before = bad.read_bytes()
    with pytest.raises(ValidationCrashed) as info:
        validate(reference, tokenizer, bad, "f16")
    text = str(info.value)
    assert f"llama.cpp was killed by SIGABRT (an abort inside llama.cpp, such as a failed GGML_ASSERT) while checking {bad}" in text
    assert "GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed" in info.value.tail[-1]  # its own line, last
    assert f"unsloth chat {bad}" in info.value.fix and "--no-validate" in info.value.fix
    assert bad.read_bytes() == before
    assert validate(reference, tokenizer, f16, "f16").passed  # and validation goes on working here


@pytest.mark.parametrize("methods", [["f16", "q8_0"], ["q8_0"]])
def test_an_export_whose_check_dies_keeps_the_file_and_the_model(tmp_path, model, tokenizer, monkeypatch, methods):
    """The f16 written, then llama.cpp aborts on it: it is kept under its final name (also when it
    was only the reference to quantize from), nothing else is made, and the model is as it was."""
    import unsloth.export.gguf as gguf_export

    real = gguf_export.write_gguf

    def write_then_damage(*args, **kwargs):
        real(*args, **kwargs)
        duplicate_a_token(args[3])

    monkeypatch.setattr(gguf_export, "write_gguf", write_then_damage)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(ValidationCrashed) as info:
        save_pretrained_gguf(model, tmp_path, tokenizer, methods)
    kept = tmp_path / "model.F16.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.F16.gguf"]  # no partial, no q8_0
    assert f"while checking {kept}" in str(info.value) and f"{kept} is kept as written" in str(info.value)
    assert all(torch.equal(weights[name], p) for name, p in model.named_parameters())


def _child(monkeypatch, source: str, *args: str) -> None:
    monkeypatch.setattr(validate_child, "COMMAND", [sys.executable, "-c", textwrap.dedent(source), *args])


def test_a_child_that_hangs_is_stopped_at_the_timeout(tmp_path, f16, reference, tokenizer, monkeypatch):
    pid_file = tmp_path / "pid"
    _child(monkeypatch, """
        import os, sys, time
        print("loading the model", file=sys.stderr, flush=True)
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(600)
        """, str(pid_file))
    monkeypatch.setenv(validate_child.TIMEOUT_ENV, "2")
    with pytest.raises(ValidationCrashed, match=f"llama.cpp gave no answer in 2 s and was stopped while checking {f16}") as info:
        validate(reference, tokenizer, f16, "f16")
    assert info.value.tail == ["loading the model"]
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_child_that_exits_with_an_error_gives_its_code_and_last_lines(f16, reference, tokenizer, monkeypatch):
    _child(monkeypatch, """
        import sys
        sys.stderr.write("".join(f"line {i}\\n" for i in range(30)))
        sys.exit(3)
        """)
    with pytest.raises(ValidationCrashed, match="llama.cpp exited with code 3 while checking") as info:
        validate(reference, tokenizer, f16, "f16")
    assert info.value.tail == [f"line {i}" for i in range(30 - validate_child.TAIL_LINES, 30)]
    assert info.value.to_json()["output"] == info.value.tail and "line 29" in str(info.value)


def test_a_file_llama_cpp_refuses_gives_the_same_error_as_in_process(tmp_path, f16, reference, tokenizer):
    short = tmp_path / "short.gguf"
    short.write_bytes(f16.read_bytes()[: f16.stat().st_size // 2])
    with pytest.raises(ExportError) as here:
        runtime.load(short)
    with pytest.raises(ExportError) as there:
        validate(reference, tokenizer, short, "f16")
    assert type(there.value) is ExportError
    assert (there.value.problem, there.value.fix, there.value.kept) == (here.value.problem, here.value.fix, here.value.kept)


def test_the_child_gives_what_llama_cpp_gives_in_process(f16, reference, tokenizer):
    report = validate(reference, tokenizer, f16, "f16")
    n_ctx = max(len(p) + len(t) for p, t in zip(reference.prompts, reference.tokens)) + 8
    llm = runtime.load(f16, n_ctx=n_ctx, gpu=False, logits_all=True)
    try:
        for result, prompt, tokens in zip(report.prompts, reference.prompts, reference.tokens):
            logits = runtime.next_token_logits(llm, prompt + tokens[:-1])[len(prompt) - 1:]
            assert result.candidate == [int(i) for i in logits.argmax(axis=-1)]
        ids = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TOKENIZER_SAMPLES]
    finally:
        llm.close()
    assert ids == [tokenizer(t)["input_ids"] for t in TOKENIZER_SAMPLES] and report.tokenizer_mismatches == []
    assert report.passed and report.identical


def test_the_child_does_not_load_torch_or_transformers():
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import sys, unsloth.export.validate_child; "
                           "print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                          capture_output=True, text=True, env=validate_child._environment(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_one_child_serves_validations_in_turn_and_ends_when_idle(f16, reference, tokenizer, monkeypatch):
    validate(reference, tokenizer, f16, "f16")
    child = validate_child._child.process
    assert validate(reference, tokenizer, f16, "f16").passed and validate_child._child.process is child
    monkeypatch.setattr(validate_child, "IDLE_SECONDS", 0.1)
    validate(reference, tokenizer, f16, "f16")
    assert child.wait(timeout=60) == 0  # closed by the idle timer: its input ended, it exited cleanly
    assert validate(reference, tokenizer, f16, "f16").passed  # and the next validation starts another
    assert validate_child._child.process is not child


def test_ctrl_c_while_the_child_works_stops_it_and_the_next_check_gets_a_new_one(tmp_path, f16, reference, tokenizer,
                                                                                  monkeypatch):
    import os
    import signal
    import threading
    import time

    marker = tmp_path / "asked"
    _child(monkeypatch, """
        import sys, time
        sys.stdin.readline()
        open(sys.argv[1], "w").write("asked")
        time.sleep(600)
        """, str(marker))

    def interrupt_once_asked():
        while not marker.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C's handler, also where the suite runs as a `&` job (which inherits SIGINT as ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_asked, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            validate(reference, tokenizer, f16, "f16")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert validate_child._child is None  # the busy child was stopped, not kept to answer late
    assert not [p for p in psutil.Process().children() if str(marker) in p.cmdline()]
    monkeypatch.undo()
    assert validate(reference, tokenizer, f16, "f16").passed


def test_a_bad_timeout_setting_is_refused_before_any_file(tmp_path, model, tokenizer, monkeypatch):
    monkeypatch.setenv(validate_child.TIMEOUT_ENV, "soon")
    with pytest.raises(ExportError, match="UNSLOTH_VALIDATE_TIMEOUT='soon' is not a number of seconds"):
        save_pretrained_gguf(model, tmp_path / "out", tokenizer, "f16")
    assert not (tmp_path / "out").exists()
