"""Commands hand back results and one renderer prints them: text as users have always seen it, JSON
where the command has --json, and the exit code taken from the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unsloth.commands import render
from unsloth.commands import results as r
from unsloth.errors import ExitCode


def _export_result(tmp_path: Path, *, agreeing: bool):
    from unsloth.export.gguf import ExportResult
    from unsloth.export.validate import PromptResult, Validation

    files = {"q4_k_m": tmp_path / "run.Q4_K_M.gguf"}
    tokens = [1, 2, 3, 4]
    candidate = tokens if agreeing else [9, 9, 9, 4]

    def check(method, candidate):
        return Validation(method, "x.gguf", [PromptResult("hi", tokens, candidate, [0.5] * 4)], 0.01, "float32")

    return ExportResult(files=files, validations={"f16": check("f16", tokens), "q4_k_m": check("q4_k_m", candidate)},
                        modelfile=tmp_path / "Modelfile")


def test_export_text_names_each_file_its_size_and_check(tmp_path, capsys):
    exported = r.Exported(_export_result(tmp_path, agreeing=True), {"q4_k_m": 3 * 1024**2})
    assert render.show(exported) == ExitCode.OK
    out, err = capsys.readouterr()
    path = tmp_path / "run.Q4_K_M.gguf"
    assert out.splitlines() == [
        "reference f16 (not kept)", "  " + exported.result.validations["f16"].summary(),
        f"{path}  (3.0 MiB)", "  " + exported.result.validations["q4_k_m"].summary(),
        f"{tmp_path / 'Modelfile'}  (ollama create NAME -f {tmp_path / 'Modelfile'})",
        f"try it: unsloth chat {path}",
    ]
    assert err == ""


def test_a_weak_quantization_warns_on_stderr_and_in_json(tmp_path, capsys):
    exported = r.Exported(_export_result(tmp_path, agreeing=False), {"q4_k_m": 1024})
    assert render.show(exported) == ExitCode.OK  # a warning, not a failure: the files are written
    assert "prefer a larger method" in capsys.readouterr().err
    assert render.show(exported, as_json=True) == ExitCode.OK
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["files"] == {"q4_k_m": str(tmp_path / "run.Q4_K_M.gguf")}


def test_train_results(capsys):
    assert render.show(r.Trained("out", "out/merged")) == ExitCode.OK
    assert capsys.readouterr().out == "done: adapters in out/lora, merged model in out/merged\n"
    assert render.show(r.Trained("out")) == ExitCode.OK
    assert capsys.readouterr().out == "done: adapters in out/lora\n"
    assert render.show(r.Trained("out", full_finetuning=True)) == ExitCode.OK
    assert capsys.readouterr().out == "done: the fine-tuned model in out\n"
    assert render.show(r.TrainInterrupted("out")) == ExitCode.INTERRUPTED
    out, err = capsys.readouterr()
    assert out == "" and "interrupted; checkpoints so far are kept in out (add --resume" in err


@pytest.mark.parametrize(("losses", "code"), [([3.0, 1.0], ExitCode.OK), ([1.0, 1.5], ExitCode.FAILED),
                                              ([], ExitCode.FAILED)])
def test_the_demo_succeeds_when_its_loss_fell(losses, code, capsys):
    assert render.show(r.DemoRun(losses)) == code
    assert capsys.readouterr().out == ""  # it reported as it ran


def test_env_results(tmp_path, capsys):
    rows = [{"name": "one", "active": True, "status": "ready", "backend": "cpu", "torch": "2.13.0", "path": "/e/one"}]
    assert render.show(r.EnvListing(rows, tmp_path)) == ExitCode.OK
    assert capsys.readouterr().out == "* one  ready      cpu   torch 2.13.0         /e/one\n"
    assert render.show(r.EnvListing([], tmp_path)) == ExitCode.OK
    assert capsys.readouterr().out == f"No environments under {tmp_path}.\n"
    assert render.show(r.EnvListing(rows, tmp_path), as_json=True) == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == rows

    assert render.show(r.NoEnvironment(tmp_path, ("unsloth env: repaired",))) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "unsloth env: repaired" and "run `unsloth install`" in err

    lock = r.EnvLock("# lock\n--extra-index-url x\ntorch==2.13\npeft==0.18\n", "one")
    assert render.show(lock) == ExitCode.OK
    assert capsys.readouterr().out == lock.text  # without -o, the lock is the output
    assert render.show(r.EnvLock(lock.text, "one", tmp_path / "l.txt")) == ExitCode.OK
    out, err = capsys.readouterr()
    assert out == "" and f"Wrote {tmp_path / 'l.txt'} (2 packages) from one." in err


def test_a_command_that_printed_as_it_went_gives_its_code():
    assert render.show(130) == 130


def test_a_result_without_a_json_form_is_a_bug_not_silence():
    with pytest.raises(TypeError):
        render.show(r.Trained("out"), as_json=True)


def test_install_outcomes(tmp_path, capsys):
    """install / update hand back what they ended with; the renderer says it as the manager used to."""
    bin_dir = tmp_path / "bin"
    exposed = r.Exposure(bin_dir / "unsloth", bin_dir, (tmp_path / ".bashrc",), on_path=False)
    assert render.show(r.Installed("b", "cuda", exposed, previous="a")) == ExitCode.OK
    assert capsys.readouterr().out.splitlines() == [
        f"Added {bin_dir} to PATH in {tmp_path / '.bashrc'}",
        f'Open a new terminal (or run: export PATH="{bin_dir}:$PATH") to use `unsloth`.',
        "Ready: environment b is active (cuda).",
        "The previous one (a) is kept: `unsloth rollback` returns to it."]
    quiet = r.Exposure(bin_dir / "unsloth", bin_dir)
    assert render.show(r.UpToDate("a", "rocm", quiet)) == ExitCode.OK
    assert capsys.readouterr().out == "Up to date: a already matches this plan (rocm). Nothing to do.\n"
    assert render.show(r.UpToDate("a", "rocm", quiet, newest=True)) == ExitCode.OK
    assert capsys.readouterr().out == "Up to date: a already has the newest versions for this plan.\n"

    step = r.BuildRefused("the [packages] failed", "fix [/this]", tmp_path / "01.log", "a", tail="[notice] pip\nerror: x")
    assert render.show(step) == ExitCode.FAILED
    said = capsys.readouterr().out
    assert "✗ the [packages] failed\n[notice] pip\nerror: x\n" in said  # tool output is not markup
    assert f"Full log: {tmp_path / '01.log'}  (that build was removed)" in said
    assert said.endswith("Likely fix: fix [/this]\nNothing changed: a is still the active environment.\n")
    verified = r.BuildRefused("torch cannot see the GPU", "update the driver", tmp_path / "logs", None,
                              found=("torch.cuda.is_available() is False",))
    assert render.show(verified) == ExitCode.FAILED
    assert capsys.readouterr().out.splitlines() == [
        "✗ torch cannot see the GPU", "  - torch.cuda.is_available() is False",
        f"Logs: {tmp_path / 'logs'}  (that build was removed)", "Likely fix: update the driver",
        "Nothing was installed; your system is as it was."]
    assert render.show(r.BuildInterrupted("a")) == ExitCode.INTERRUPTED
    assert capsys.readouterr().out.splitlines() == [
        "Interrupted: the half-built environment was removed.", "Nothing changed: a is still the active environment."]
    assert render.show(r.Declined()) == ExitCode.FAILED
    assert capsys.readouterr().out == "Nothing changed.\n"


def test_rollback_and_uninstall_outcomes(tmp_path, capsys):
    assert render.show(r.RolledBack(active="a", was="b")) == ExitCode.OK
    assert capsys.readouterr().out == "Rolled back: a is active again (was b; `unsloth rollback` swaps back).\n"
    assert render.show(r.NothingToRollBack()) == ExitCode.FAILED
    assert capsys.readouterr().out == "Nothing to roll back to: there is no previous environment.\n"
    gone = r.Uninstalled((tmp_path / "bin" / "unsloth", tmp_path / "envs"), (tmp_path / ".profile",),
                         (("Hugging Face models and datasets: yours, kept", tmp_path / "hf", 3 * 1024**3),))
    assert render.show(gone) == ExitCode.OK
    assert capsys.readouterr().out.splitlines() == [
        f"removing {tmp_path / 'bin' / 'unsloth'}", f"removing {tmp_path / 'envs'}",
        f"removed the PATH line from {tmp_path / '.profile'}", "Uninstalled; your training outputs are kept.",
        f"  kept {tmp_path / 'hf'} (3.0 GB): Hugging Face models and datasets: yours, kept"]


def test_rollback_through_the_cli_with_nothing_to_return_to(tmp_path, monkeypatch, capsys):
    from unsloth.cli import main

    monkeypatch.setenv("UNSLOTH_HOME", str(tmp_path / "home"))
    assert main(["rollback"]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert out == "Nothing to roll back to: there is no previous environment.\n" and "Traceback" not in err
