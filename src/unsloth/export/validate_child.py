"""llama.cpp's side of validation, run in a child process (``python -m unsloth.export.validate_child``).

A file llama.cpp cannot handle can end in an abort (a failed GGML_ASSERT), a crash or a hang inside
llama.cpp, which in the user's own process would take their Python with it: the notebook kernel
dies and the trained model in memory is lost. So the exporting process sends the child only data
(the GGUF's path, token ids, texts), one JSON line per request on its stdin, and reads one JSON
line back from its stdout; the comparison with transformers stays in the parent (validate.py).
The child never imports torch or sees the model, and runs llama.cpp on the CPU with the GPUs
hidden, so it takes no GPU memory beside the parent's model. A child that dies or hangs becomes
ValidationCrashed: the file, how the child ended, its last lines of output and the fix."""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from unsloth.export import runtime
from unsloth.export.errors import ExportError

COMMAND = [sys.executable, "-m", __name__]  # the child; tests put a program that dies or hangs here
TIMEOUT_ENV = "UNSLOTH_VALIDATE_TIMEOUT"  # seconds; else TIMEOUT_BASE + TIMEOUT_PER_GIB per GiB checked
TIMEOUT_BASE, TIMEOUT_PER_GIB = 300.0, 60.0
TAIL_LINES = 12
FIX = ("llama-cpp-python here may be older than the file needs: update it (`unsloth install`, or `pip install -U "
       "llama-cpp-python`) and try the file with `unsloth chat {file}`; if that fails too, please report it (an "
       "exporter bug for this model); --no-validate (validate_export=False) exports without this check, and "
       f"{TIMEOUT_ENV}=SECONDS gives a slow machine more time")
_HOW = {  # what a signal most likely means here
    "SIGABRT": "an abort inside llama.cpp, such as a failed GGML_ASSERT",
    "SIGSEGV": "a crash inside llama.cpp",
    "SIGKILL": "killed from outside, often by the system running out of memory",
}
log = logging.getLogger(__name__)


class ValidationCrashed(ExportError):
    """The child running llama.cpp died or hung: nothing is known about the file, which is kept, and
    the model in this process was never touched."""

    def __init__(self, file: str | Path, how: str, output: str, *, kept: str | None = None):
        self.file, self.how, self.output = Path(file), how, output
        self.tail = [line[:300] for line in output.splitlines() if line.strip()][-TAIL_LINES:]
        said = "" if self.tail else " (it printed nothing)"
        super().__init__(f"llama.cpp {how} while checking {self.file}{said}", FIX.format(file=self.file),
                         kept=kept or f"{self.file} is untouched, and so is the model in this process")

    def __str__(self) -> str:  # llama.cpp's last words go under the problem, what was kept and the fix
        return super().__str__() + ("\n  llama.cpp's last output:" + "".join(f"\n    {line}" for line in self.tail)
                                    if self.tail else "")

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "output": self.tail}

    def kept_as(self, final: Path) -> ValidationCrashed:
        """The same error for the file under its final name (the one the user sees), kept there."""
        return ValidationCrashed(final, self.how, self.output,
                                 kept=f"{final} is kept as written (not validated); the model in this process is untouched")


def timeout_for(*files: str | Path) -> float:
    """Seconds the child may take over ``files``; with none, just checks the setting (before any work)."""
    if os.environ.get(TIMEOUT_ENV):
        value = os.environ[TIMEOUT_ENV]
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not seconds > 0:
            raise ExportError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds",
                              fix=f"set it to the seconds validation may take (e.g. {TIMEOUT_ENV}=3600), or unset it",
                              kept="nothing was written")
        return seconds
    size = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
    return TIMEOUT_BASE + TIMEOUT_PER_GIB * size / 1024**3


def _environment() -> dict[str, str]:
    import unsloth

    env = dict(os.environ)
    # the same unsloth as this process, even when it was put on sys.path by hand (a notebook)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(unsloth.__file__).parents[1]), env.get("PYTHONPATH")) if p)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CUDA and HIP: validation runs on the CPU, the GPU stays the model's
    env.setdefault("GGML_NO_BACKTRACE", "1")  # a failed assert's own line ends the output (no gdb attached)
    return env


class _Child:
    """One child process answering requests in turn, one JSON line each way; what it prints (llama.cpp's
    log) is read as it comes, its last lines kept for the error and the rest logged at DEBUG."""

    def __init__(self) -> None:
        self.command, self.owner = list(COMMAND), os.getpid()
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
                                        env=_environment())
        self.answers: queue.Queue[str | None] = queue.Queue()
        self.output: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.readers = [threading.Thread(target=self._read_answers, daemon=True),
                        threading.Thread(target=self._read_output, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read_answers(self) -> None:
        for line in self.process.stdout:
            self.answers.put(line)
        self.answers.put(None)  # the child is gone

    def _read_output(self) -> None:
        for line in self.process.stderr:
            if line.strip():
                self.output.append(line.rstrip()[:300])
                log.debug("llama.cpp: %s", line.rstrip())

    def usable(self) -> bool:
        return self.process.poll() is None and self.command == COMMAND and self.owner == os.getpid()

    def ask(self, request: dict[str, Any], file: str | Path, timeout: float) -> dict[str, Any]:
        self.output.clear()
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.answers.get(timeout=timeout)
        except OSError:  # it died before reading the request
            line = None
        except queue.Empty:
            self.close(wait=0)
            raise ValidationCrashed(file, f"gave no answer in {round(timeout, 1):g} s and was stopped", self._last_words()) from None
        if line is None:
            raise ValidationCrashed(file, _ending(self.process.wait()), self._last_words())
        return json.loads(line)

    def _last_words(self) -> str:
        self.readers[1].join(timeout=5)  # its stderr ends with it
        return "\n".join(self.output)

    def close(self, wait: float = 5) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # the child's loop ends at end of input
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _ending(returncode: int) -> str:
    if returncode < 0:
        number = -returncode
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        meaning = _HOW.get(name)
        return f"was killed by {name}" + (f" ({meaning})" if meaning else "")
    return f"exited with code {returncode}" if returncode else "exited without an answer"


# One child serves the validations of this process (its import and llama.cpp's start-up are paid once),
# closed once idle for IDLE_SECONDS; a new one starts after one dies.
IDLE_SECONDS = 60.0
_lock = threading.Lock()
_child: _Child | None = None
_idle: threading.Timer | None = None


def run(request: dict[str, Any], file: str | Path, *, also: tuple[str | Path, ...] = ()) -> dict[str, Any]:
    """The child's answer to ``request`` about ``file`` (and the files in ``also``, for the timeout).
    An ExportError inside the child (a file llama.cpp refuses) is raised here as it was there."""
    global _child, _idle
    timeout = timeout_for(file, *also)
    with _lock:
        if _idle is not None:
            _idle.cancel()
        if _child is None or not _child.usable():
            _child = _Child()
        child = _child
        try:
            answer = child.ask(request, file, timeout)
        except BaseException:  # died, hung, or this process was interrupted mid-answer: never asked again
            _child = None
            child.close(wait=0)
            raise
        _idle = threading.Timer(IDLE_SECONDS, close)
        _idle.daemon = True
        _idle.start()
    if "error" in answer:
        raise ExportError(**answer["error"])
    return answer


def close() -> None:
    """End the idle child, if there is one (it also ends with this process: its input closes)."""
    global _child
    with _lock:
        if _child is not None:
            _child.close()
            _child = None


atexit.register(close)


# The child's side: each check reads its request and returns plain data.

def _tokens(request: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's top-1 token at each position from ``start`` of each sequence (teacher forcing), and
    its tokenization of each sample text with the text back from those ids."""
    llm = runtime.load(request["file"], n_ctx=request["n_ctx"], gpu=False, logits_all=True, verbose=True)
    try:
        candidates = [[int(i) for i in runtime.next_token_logits(llm, tokens)[start:].argmax(axis=-1)]
                      for tokens, start in zip(request["sequences"], request["starts"])]
        tokenized = []
        for text in request["samples"]:
            ids = llm.tokenize(text.encode(), add_bos=True, special=True)
            tokenized.append([ids, llm.detokenize(ids, special=True).decode("utf-8", errors="replace")])
    finally:
        llm.close()
    return {"candidates": candidates, "tokenized": tokenized}


def _image(request: dict[str, Any]) -> dict[str, Any]:
    """(prompt tokens one image added, reply tokens) of one greedy chat turn with the projector file."""
    from PIL import Image

    picture = Image.new("RGB", (64, 64))
    picture.putdata([(4 * (i % 64), 4 * (i // 64), 128) for i in range(64 * 64)])
    llm = runtime.load(request["file"], n_ctx=1024, gpu=False, mmproj=request["mmproj"], verbose=True)
    try:
        def turn(content):
            out = llm.create_chat_completion([{"role": "user", "content": content}], max_tokens=4, temperature=0.0)
            return out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]

        text = [{"type": "text", "text": "What is in this picture?"}]
        with_image, reply = turn([{"type": "image_url", "image_url": {"url": runtime.image_url(picture)}}, *text])
        without, _ = turn(text)
    finally:
        llm.close()
    return {"image_tokens": with_image - without, "reply_tokens": reply}


CHECKS = {"tokens": _tokens, "image": _image}


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends this child
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever llama.cpp prints goes with its log to stderr; stdout carries only the answers
    sys.stdout = sys.stderr
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        try:
            result = CHECKS[request["check"]](request)
        except ExportError as exc:
            result = {"error": {"problem": exc.problem, "fix": exc.fix, "kept": exc.kept}}
        answers.write(json.dumps(result) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
