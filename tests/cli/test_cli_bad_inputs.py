"""Bad input through the real entry point (`unsloth.cli.main`): for each, the exact exit code, no
traceback, a message that names the problem and a fix, and nothing written or changed.

One row per input a user can get wrong; the first rows are issue #22's table, the rest the same
kinds of mistake. Each row builds its input in a fresh folder, runs the command and compares the
folder before and after.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from unsloth.cli import main

USAGE, FAILED = 2, 1
MODEL_ROWS = 4  # rows of the tiny dataset every train case starts from


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]  # tmp -> arguments (after the setup wrote the input there)
    code: int
    says: tuple[str, ...]  # substrings of the message: the problem (and the file), the fix's key words
    setup: Callable[[Path], None] = lambda tmp: None
    env: dict[str, str] | None = None


# --- inputs -----------------------------------------------------------------------------------------

def _write(name: str, data: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return setup


def _both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        for one in setups:
            one(tmp)
    return setup


ROW = json.dumps({"messages": [{"role": "user", "content": "Capital of Peru?"},
                               {"role": "assistant", "content": "Lima"}]})
GOOD_DATA = _write("d.jsonl", "\n".join([ROW] * MODEL_ROWS) + "\n")


def _model_folder(name: str = "model", drop: tuple[str, ...] = (), config: dict | None = None,
                  files: dict[str, bytes] | None = None) -> Callable[[Path], None]:
    """A model folder as save_pretrained leaves it (a small but whole safetensors file), then spoiled."""
    def setup(tmp: Path) -> None:
        folder = tmp / name
        folder.mkdir()
        settings = {"model_type": "llama", "hidden_size": 8, "architectures": ["LlamaForCausalLM"]}
        settings.update(config or {})
        for key in drop:
            settings.pop(key)
        (folder / "config.json").write_text(json.dumps(settings))
        header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
        for file, data in (files or {}).items():
            if data is None:
                (folder / file).unlink()
            else:
                (folder / file).write_bytes(data)
    return setup


def _config(tmp: Path, model: str = "model", dataset: str = "d.jsonl", lora: str = "r = 4",
            training: str = "max_steps = 1", extra: str = "") -> str:
    path = tmp / "c.toml"
    path.write_text(f'{extra}\n[model]\nname = "{tmp / model}"\n[dataset]\nname = "{tmp / dataset}"\n'
                    f'[lora]\n{lora}\n[training]\n{training}\n')
    return str(path)


def train(setup_config: Callable[[Path], str] = _config, *more: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", setup_config(tmp), "--output-dir", str(tmp / "out"), *more]


def _tiny_gguf(tmp: Path) -> Path:
    """A whole GGUF written by the gguf package: a header with metadata and one 600 kB tensor."""
    import gguf
    import numpy as np

    path = tmp / "whole.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((1500, 100), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _truncated_gguf(size: int) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        whole = _tiny_gguf(tmp)
        (tmp / "m.gguf").write_bytes(whole.read_bytes()[:size])
        whole.unlink()
    return setup


def _random(name: str, size: int = 4096) -> Callable[[Path], None]:
    return _write(name, os.urandom(size).replace(b"GGUF", b"GGUX"))


def _garbage_current(tmp: Path) -> None:
    (tmp / "home").mkdir()
    (tmp / "home" / "current").write_bytes(os.urandom(200))


CASES = [
    # --- issue #22's table ---------------------------------------------------------------------------
    Case("empty-jsonl", train(), USAGE, ("d.jsonl is empty", "fix:", "nothing was trained"),
         _both(_model_folder(), _write("d.jsonl", ""))),
    Case("blank-lines-jsonl", train(), USAGE, ("only blank lines", "fix:"),
         _both(_model_folder(), _write("d.jsonl", "\n  \n\n"))),
    Case("broken-line-jsonl", train(), USAGE, ("line 3 is not valid JSON", "correct or delete line 3"),
         _both(_model_folder(), _write("d.jsonl", f"{ROW}\n{ROW}\n{{\"messages\": [\n{ROW}\n"))),
    Case("folder-of-other-files", train(lambda tmp: _config(tmp, dataset="data")), USAGE,
         ("holds no data files", "task.toml", "point dataset.name at a .jsonl"),
         _both(_model_folder(), _write("data/task.toml", "x = 1\n"), _write("data/instruction.md", "# hi\n"))),
    Case("lora-r-negative", train(lambda tmp: _config(tmp, lora="r = -4")), USAGE,
         ("lora.r = -4", "must be 1 or more", "set lora.r = 16"), _both(_model_folder(), GOOD_DATA)),
    Case("max-steps-zero", train(lambda tmp: _config(tmp, training="max_steps = 0")), USAGE,
         ("training.max_steps = 0", "would train nothing", "set training.max_steps"), _both(_model_folder(), GOOD_DATA)),
    Case("model-without-model-type", train(), USAGE, ("has no model_type", "config.json", "fix:"),
         _both(_model_folder(drop=("model_type",)), GOOD_DATA)),
    Case("generate-on-truncated-gguf", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi"], FAILED,
         ("m.gguf is damaged or truncated", "export it again"), _truncated_gguf(500_000)),
    Case("export-into-read-only-folder", lambda tmp: ["export", str(tmp / "model"), "--gguf", "f16", "--out",
                                                      _unwritable(tmp)], FAILED,
         ("cannot write into", "choose an output directory you can write to"), _model_folder()),
    *[Case(f"generate-on-gguf-cut-at-{size}", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi", "--cpu"], FAILED,
           ("m.gguf is", "fix:"), _truncated_gguf(size)) for size in (0, 10, 100, 5000)],
    *[Case(f"chat-on-gguf-cut-at-{size}", lambda tmp: ["chat", str(tmp / "m.gguf")], FAILED,
           ("m.gguf is", "fix:"), _truncated_gguf(size)) for size in (0, 10, 100, 5000, 500_000)],
    Case("generate-json-on-text-gguf", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi", "--json"], FAILED,
         ("m.gguf is not a GGUF file", "b'hell'", "pass a .gguf"), _write("m.gguf", "hello, I am text\n")),
    Case("chat-on-text-gguf", lambda tmp: ["chat", str(tmp / "m.gguf")], FAILED,
         ("not a GGUF file",), _write("m.gguf", "hello, I am text\n")),
    Case("install-with-random-matrix", lambda tmp: ["install", "--dry-run"], USAGE,
         ("matrix.toml (set by UNSLOTH_MATRIX)", "not text", "unset it"), _random("matrix.toml"),
         env={"UNSLOTH_MATRIX": "{tmp}/matrix.toml"}),
    Case("doctor-with-random-matrix", lambda tmp: ["doctor", "--quick"], FAILED,
         ("matrix.toml (set by UNSLOTH_MATRIX)", "unset it"), _random("matrix.toml"),
         env={"UNSLOTH_MATRIX": "{tmp}/matrix.toml"}),
    Case("without-not-a-part", lambda tmp: ["install", "--yes", "--without", "export,gpu"], USAGE,
         ("--without gpu: not an optional part", "llama-cpp")),
    Case("garbage-current-pointer", lambda tmp: ["env", "path"], FAILED,
         ("current is damaged", "unsloth install"), _garbage_current),
    # --- more of the same kinds -----------------------------------------------------------------------
    Case("jsonl-line-is-a-list", train(), USAGE, ("line 2 is list JSON, not an object",),
         _both(_model_folder(), _write("d.jsonl", f"{ROW}\n[1, 2]\n"))),
    Case("jsonl-not-utf8", train(), USAGE, ("line 2 is not UTF-8",),
         _both(_model_folder(), _write("d.jsonl", ROW.encode() + b"\n\xff\xfe\x00\n"))),
    Case("empty-dataset-folder", train(lambda tmp: _config(tmp, dataset="data")), USAGE,
         ("holds no data files", "it holds: nothing"), _both(_model_folder(), lambda tmp: (tmp / "data").mkdir())),
    Case("folder-with-an-empty-jsonl", train(lambda tmp: _config(tmp, dataset="data")), USAGE,
         ("part.jsonl is empty",), _both(_model_folder(), _write("data/part.jsonl", ""))),
    Case("json-array-without-rows", train(lambda tmp: _config(tmp, dataset="d.json")), USAGE,
         ("the array holds no rows",), _both(_model_folder(), _write("d.json", "[]"))),
    Case("json-array-broken", train(lambda tmp: _config(tmp, dataset="d.json")), USAGE,
         ("not valid JSON at line 2",), _both(_model_folder(), _write("d.json", "[\n{\"text\": }\n]"))),
    Case("csv-header-only", train(lambda tmp: _config(tmp, dataset="d.csv")), USAGE,
         ("no rows under its header line",), _both(_model_folder(), _write("d.csv", "text\n"))),
    Case("parquet-that-is-not", train(lambda tmp: _config(tmp, dataset="d.parquet")), USAGE,
         ("not a Parquet file",), _both(_model_folder(), _write("d.parquet", "text\nhello\n"))),
    Case("dataset-missing", train(lambda tmp: _config(tmp, dataset="gone.jsonl")), USAGE,
         ("gone.jsonl does not exist",), _model_folder()),
    Case("lora-r-zero", train(lambda tmp: _config(tmp, lora="r = 0")), USAGE, ("lora.r = 0",),
         _both(_model_folder(), GOOD_DATA)),
    Case("lora-alpha-zero", train(lambda tmp: _config(tmp, lora="alpha = 0")), USAGE, ("lora.alpha = 0",),
         _both(_model_folder(), GOOD_DATA)),
    Case("lora-dropout-above-one", train(lambda tmp: _config(tmp, lora="dropout = 1.5")), USAGE,
         ("lora.dropout = 1.5",), _both(_model_folder(), GOOD_DATA)),
    Case("lora-r-text", train(lambda tmp: _config(tmp, lora='r = "big"')), USAGE,
         ("lora.r: expected a whole number",), _both(_model_folder(), GOOD_DATA)),
    Case("max-steps-negative", train(lambda tmp: _config(tmp, training="max_steps = -5")), USAGE,
         ("training.max_steps = -5", "or -1"), _both(_model_folder(), GOOD_DATA)),
    Case("learning-rate-zero", train(lambda tmp: _config(tmp, training="learning_rate = 0.0")), USAGE,
         ("training.learning_rate = 0.0", "set training.learning_rate = 2e-4"), _both(_model_folder(), GOOD_DATA)),
    Case("learning-rate-negative", train(lambda tmp: _config(tmp, training="learning_rate = -2e-4")), USAGE,
         ("training.learning_rate = -0.0002",), _both(_model_folder(), GOOD_DATA)),
    Case("learning-rate-huge", train(lambda tmp: _config(tmp, training="learning_rate = 20.0")), USAGE,
         ("at most 1",), _both(_model_folder(), GOOD_DATA)),
    Case("batch-size-zero", train(lambda tmp: _config(tmp, training="per_device_train_batch_size = 0")), USAGE,
         ("per_device_train_batch_size = 0",), _both(_model_folder(), GOOD_DATA)),
    Case("accumulation-zero", train(lambda tmp: _config(tmp, training="gradient_accumulation_steps = 0")), USAGE,
         ("gradient_accumulation_steps = 0",), _both(_model_folder(), GOOD_DATA)),
    Case("warmup-ratio-two", train(lambda tmp: _config(tmp, training="warmup_ratio = 2.0")), USAGE,
         ("warmup_ratio = 2.0", "between 0 and 1"), _both(_model_folder(), GOOD_DATA)),
    Case("epochs-zero", train(lambda tmp: _config(tmp, training="num_train_epochs = 0")), USAGE,
         ("num_train_epochs = 0",), _both(_model_folder(), GOOD_DATA)),
    Case("max-steps-flag-zero", train(_config, "--max-steps", "0"), USAGE, ("training.max_steps = 0",),
         _both(_model_folder(), GOOD_DATA)),
    Case("seq-length-zero", train(_config, "--max-seq-length", "0"), USAGE, ("model.max_seq_length",),
         _both(_model_folder(), GOOD_DATA)),
    Case("dataset-limit-zero", train(_config, "--set", "dataset.limit=0"), USAGE, ("dataset.limit = 0",),
         _both(_model_folder(), GOOD_DATA)),
    Case("output-dir-is-a-file", lambda tmp: ["train", _config(tmp), "--output-dir", str(tmp / "d.jsonl")], USAGE,
         ("is a file, not a folder", "--output-dir"), _both(_model_folder(), GOOD_DATA)),
    Case("unknown-model-type", train(), USAGE, ("model_type 'llamazz'", "not an architecture"),
         _both(_model_folder(config={"model_type": "llamazz"}), GOOD_DATA)),
    Case("model-without-config", train(), USAGE, ("has no config.json",),
         _both(_model_folder(files={"config.json": None}), GOOD_DATA)),
    Case("model-config-not-json", train(), USAGE, ("is not readable JSON",),
         _both(_model_folder(files={"config.json": b"{model_type: llama"}), GOOD_DATA)),
    Case("model-without-weights", train(), USAGE, ("has no weights", "model.safetensors"),
         _both(_model_folder(files={"model.safetensors": None}), GOOD_DATA)),
    Case("model-truncated-weights", train(), USAGE, ("model.safetensors is truncated",),
         _both(_model_folder(files={"model.safetensors": b"\x10\x00"}), GOOD_DATA)),
    Case("model-index-missing-shard", train(), USAGE, ("missing weight files its index lists", "part-2"),
         _both(_model_folder(files={"model.safetensors.index.json": json.dumps(
             {"weight_map": {"w": "model.safetensors", "v": "part-2.safetensors"}}).encode()}), GOOD_DATA)),
    Case("config-file-missing", lambda tmp: ["train", str(tmp / "nope.toml")], USAGE, ("no such config file",)),
    Case("config-not-toml", lambda tmp: ["train", str(tmp / "c.toml")], USAGE, ("not valid TOML",),
         _write("c.toml", "[model\nname = 1\n")),
    Case("config-typo", lambda tmp: ["train", _config(tmp, extra='output_dri = "x"')], USAGE,
         ("did you mean 'output_dir'",), _both(_model_folder(), GOOD_DATA)),
    Case("override-without-equals", train(_config, "--set", "training.max_steps"), USAGE,
         ("write it as key.path=value",), _both(_model_folder(), GOOD_DATA)),
    Case("no-config", lambda tmp: ["train"], USAGE, ("no config file given", "unsloth train --demo")),
    Case("demo-max-steps-zero", lambda tmp: ["train", "--demo", "--max-steps", "0", "--output-dir", str(tmp / "o")],
         USAGE, ("--max-steps must be 1 or more",)),
    Case("demo-unknown", lambda tmp: ["train", "--demo", "nonesuch", "--output-dir", str(tmp / "o")],
         USAGE, ("no demo called 'nonesuch'", "capitals")),
    Case("generate-on-a-gguf-folder-without-one", lambda tmp: ["generate", str(tmp), "hi"], FAILED,
         ("holds no .gguf file", "unsloth export")),
    Case("generate-on-a-folder-with-two", lambda tmp: ["generate", str(tmp), "hi"], FAILED,
         ("holds several GGUF files", "pass the one you want"), _both(_write("a.gguf", "x"), _write("b.gguf", "y"))),
    Case("generate-on-random-bytes", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi"], FAILED,
         ("not a GGUF file",), _random("m.gguf")),
    Case("generate-on-a-future-gguf", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi"], FAILED,
         ("GGUF version 99",), _write("m.gguf", b"GGUF" + struct.pack("<IQQ", 99, 0, 0))),
    Case("generate-on-a-gguf-missing-one-byte", lambda tmp: ["generate", str(tmp / "m.gguf"), "hi"], FAILED,
         ("its tensors need",), _truncated_gguf(-1)),
    Case("export-missing-checkpoint", lambda tmp: ["export", str(tmp / "gone"), "--gguf", "q8_0"], FAILED,
         ("is not a model or adapter directory",)),
    Case("export-checkpoint-without-model-type", lambda tmp: ["export", str(tmp / "model"), "--gguf", "f16"], FAILED,
         ("has no model_type",), _model_folder(drop=("model_type",))),
    Case("export-checkpoint-without-weights", lambda tmp: ["export", str(tmp / "model"), "--gguf", "f16"], FAILED,
         ("has no weights",), _model_folder(files={"model.safetensors": None})),
    Case("export-unknown-method", lambda tmp: ["export", str(tmp / "model"), "--gguf", "q4_k_x"], FAILED,
         ("unknown GGUF method 'q4_k_x'",), _model_folder()),
    Case("export-out-under-a-file", lambda tmp: ["export", str(tmp / "model"), "--gguf", "f16", "--out",
                                                 str(tmp / "model" / "config.json" / "out")], FAILED,
         ("is a file, not a folder",), _model_folder()),
    Case("install-with-missing-matrix", lambda tmp: ["install", "--dry-run"], USAGE,
         ("gone.toml (set by UNSLOTH_MATRIX): cannot read", "unset it"), env={"UNSLOTH_MATRIX": "{tmp}/gone.toml"}),
    Case("install-with-matrix-not-toml", lambda tmp: ["install", "--dry-run"], USAGE,
         ("not valid TOML",), _write("matrix.toml", "schema = [\n"), env={"UNSLOTH_MATRIX": "{tmp}/matrix.toml"}),
    Case("install-json-without-dry-run", lambda tmp: ["install", "--json"], USAGE, ("--json prints the plan", "--dry-run")),
    Case("install-from-a-dump", lambda tmp: ["install", "--yes", "--from", str(tmp)], USAGE,
         ("--from plans for another machine's dump", "add --dry-run"), _write("lspci.txt", "")),
    Case("install-missing-source", lambda tmp: ["install", "--yes", "--source", str(tmp / "gone")], USAGE,
         ("does not exist", "--source")),
    Case("detect-from-missing", lambda tmp: ["detect", "--from", str(tmp / "gone")], USAGE,
         ("not a dump directory", "unsloth doctor --dump")),
    Case("detect-from-empty", lambda tmp: ["detect", "--from", str(tmp)], USAGE, ("no probe outputs here",)),
    Case("doctor-from-and-dump", lambda tmp: ["doctor", "--from", str(tmp), "--dump", str(tmp / "d")], USAGE,
         ("--dump and --python need this machine", "drop --from")),
]


def _unwritable(tmp: Path) -> str:
    """A folder this process cannot write into: read-only to a normal user; root writes anywhere
    but /proc/sys."""
    if os.geteuid() == 0:
        return "/proc/sys/unsloth-out"
    locked = tmp / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    return str(locked / "out")


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_the_table_has_issue_22s_cases_and_thirty_more():
    assert len(CASES) >= 20 + 30 and len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_is_one_message_with_the_fix_and_changes_nothing(case, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("UNSLOTH_HOME", str(home))
    monkeypatch.setenv("UNSLOTH_BIN_DIR", str(tmp_path / "bin"))
    monkeypatch.delenv("UNSLOTH_DEBUG", raising=False)
    for name, value in (case.env or {}).items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    case.setup(tmp_path)
    argv = case.argv(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # chat reads nothing if it ever got that far

    code = main(argv)

    out, err = capsys.readouterr()
    said = out + err
    assert code == case.code, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert "fix:" in said or '"fix": "' in said, said[-3000:]
    for words in case.says:
        assert words in said, f"{words!r} not in {said[-3000:]!r}"
    assert _snapshot(tmp_path) == before  # nothing written, moved or removed (output dirs included)


def test_json_errors_are_one_object_with_the_problem_and_the_fix(tmp_path, capsys):
    (tmp_path / "m.gguf").write_text("hello, I am text\n")
    assert main(["generate", str(tmp_path / "m.gguf"), "hi", "--json"]) == FAILED
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "not a GGUF file" in report["error"] and report["fix"]
    assert report["exit_code"] == FAILED


def test_without_takes_the_comma_form_it_documents(monkeypatch):
    from unsloth.commands.install import optional_parts

    assert optional_parts(["export,llama-cpp", "bitsandbytes"]) == ["export", "llama-cpp", "bitsandbytes"]
    assert optional_parts(["export, train"]) == ["export", "train"]


def test_an_unexpected_error_is_one_line_and_its_traceback_on_request(monkeypatch, capsys):
    def crash(args):
        raise RuntimeError("boom")

    monkeypatch.setattr("unsloth.commands.envs.run_list", crash)
    import unsloth.cli

    parser = unsloth.cli.build_parser()
    monkeypatch.setattr(unsloth.cli, "build_parser", lambda: _with_func(parser, crash))
    monkeypatch.delenv("UNSLOTH_DEBUG", raising=False)
    assert main(["env", "list"]) == 70
    err = capsys.readouterr().err
    assert "Traceback" not in err and "RuntimeError: boom" in err and "--verbose" in err
    assert main(["env", "list", "--verbose"]) == 70
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("UNSLOTH_DEBUG", "1")
    assert main(["env", "list"]) == 70
    assert "Traceback" in capsys.readouterr().err


def _with_func(parser, func):
    """``parser`` with `env list` running ``func``."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            env = action.choices["env"]
            for sub in env._actions:
                if isinstance(sub, argparse._SubParsersAction):
                    sub.choices["list"].set_defaults(func=func)
    return parser


def test_docs_list_every_exit_code():
    """docs/cli.md's table is `ExitCode`, row for row: a new code cannot go undocumented."""
    import re

    from unsloth.errors import ExitCode

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| \S", text, re.M)
    assert [(int(code), name) for code, name in rows] == [(int(c), c.name) for c in ExitCode]
