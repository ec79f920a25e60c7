"""Doctor's vLLM check: only in an environment the install put vLLM in (its receipt's plan has it), and
there: it imports, its version, and the torch its metadata pins against the torch installed. Run on a
fake-installed vLLM (a dist-info folder and a package), never a real one."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from unsloth.plan import Vllm
from unsloth.platform.facts import Platform
from unsloth.selftest import script
from unsloth.selftest.judge import opt_in_checks, probe_findings, skipped_env_findings
from unsloth.selftest.run import ProbeRun

TORCH = importlib.metadata.version("torch")  # this venv's (2.13.0+cpu, say)
VLLM = Vllm("pypi", "vllm==0.32.0", "torch==2.13.0", ">=3.11,<3.15", "")


def fake_vllm(site: Path, *, torch_pin: str | None, imports: bool = True, version: str = "0.32.0") -> Path:
    """vLLM as an installer leaves it for importlib.metadata: a dist-info with its Requires-Dist, and the package."""
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir(parents=True)
    requires = [f"Requires-Dist: torch=={torch_pin}"] if torch_pin else []
    (dist / "METADATA").write_text("\n".join(["Metadata-Version: 2.1", "Name: vllm", f"Version: {version}",
                                              "Requires-Dist: transformers>=5.16.1", *requires,
                                              'Requires-Dist: pytest; extra == "test"']) + "\n")
    (site / "vllm").mkdir()
    body = f"__version__ = {version!r}\n" if imports else "raise RuntimeError('must not be imported')\n"
    (site / "vllm" / "__init__.py").write_text(body)
    return site


@pytest.fixture
def state():
    import torch

    return {"torch": torch}


@pytest.fixture
def on_path(monkeypatch):
    def put(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delitem(sys.modules, "vllm", raising=False)

    yield put
    sys.modules.pop("vllm", None)


def test_a_vllm_built_for_this_torch_imports_and_says_both_versions(tmp_path, state, on_path):
    on_path(fake_vllm(tmp_path, torch_pin=TORCH.split("+")[0]))
    ok, message, facts = script.check_vllm(state)
    assert ok and message == f"vLLM 0.32.0 imports, built for torch {TORCH.split('+')[0]} (torch {TORCH} here)"
    assert facts == {"version": "0.32.0", "torch_pin": TORCH.split("+")[0], "torch": TORCH, "matches": True}


def test_a_vllm_built_for_another_torch_is_a_mismatch_and_is_not_imported(tmp_path, state, on_path):
    on_path(fake_vllm(tmp_path, torch_pin="2.12.1", imports=False))  # importing it would raise
    ok, message, facts = script.check_vllm(state)
    assert ok is False and message == f"vLLM 0.32.0 is built for torch 2.12.1, but torch {TORCH} is installed"
    assert facts["matches"] is False


def test_no_vllm_installed_says_so(tmp_path, state, on_path, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distribution",
                        lambda name: (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name)))
    assert script.check_vllm(state) == (False, "vLLM is not installed", {})


def test_torch_pins_are_read_from_requires_dist_forms():
    assert script.torch_pin(["numpy", "torch==2.13.0", "torchvision==0.28.0"]) == "2.13.0"
    assert script.torch_pin(["torch (==2.13.0)"]) == "2.13.0"  # the older form in METADATA
    assert script.torch_pin(['torch==2.13.0; platform_system == "Linux"']) == "2.13.0"
    assert script.torch_pin(["torchaudio==2.11.0", "torch>=2.9"]) is None and script.torch_pin(None) is None


def _run(vllm_line: dict | None) -> ProbeRun:
    results = {"torch": {"check": "torch", "ok": True, "message": f"torch {TORCH} (cpu build)", "backend": "cpu"},
               "gpu": {"check": "gpu", "ok": False, "message": "torch sees no GPU", "count": 0, "devices": []},
               "matmul": {"check": "matmul", "ok": True, "message": "256x256 matmul on cpu"},
               "bitsandbytes": {"check": "bitsandbytes", "ok": True, "message": "bitsandbytes NF4"},
               "triton": {"check": "triton", "ok": True, "message": "Triton (interpreter)"},
               "fla": {"check": "fla", "ok": False, "message": "flash-linear-attention is not installed"},
               "llama_cpp": {"check": "llama_cpp", "ok": True, "message": "llama-cpp-python", "gpu_offload": False},
               "multi_gpu": {"check": "multi_gpu", "ok": None, "message": "0 GPU(s): nothing to connect"}}
    if vllm_line is not None:
        results["vllm"] = {"check": "vllm", **vllm_line}
    return ProbeRun(results=results, returncode=0)


def test_the_judge_reports_vllm_only_when_the_environment_has_it(make_plan):
    plan = make_plan(vllm=VLLM)
    found = probe_findings(_run({"ok": True, "message": "vLLM 0.32.0 imports"}), Platform(), plan, (), ("vllm",))
    ids = [f.id for f in found]
    assert ids[-2:] == ["env-vllm", "env-multi-gpu"]  # before the check that can hang
    assert found[-2].status == "ok" and found[-2].title == "vLLM"
    bad = probe_findings(_run({"ok": False, "message": "vLLM 0.32.0 is built for torch 2.12.1"}), Platform(), plan,
                         (), ("vllm",))[-2]
    assert bad.status == "error" and not bad.fails and bad.fix == "unsloth install --force"  # GRPO falls back
    assert "falls back to unsloth's own generation" in bad.message
    # Without vLLM in the environment: no vLLM finding at all, whatever the probe printed.
    assert "env-vllm" not in [f.id for f in probe_findings(_run(None), Platform(), make_plan(), ())]
    assert "env-vllm" not in [f.id for f in skipped_env_findings("Skipped by --quick")]
    assert "env-vllm" in [f.id for f in skipped_env_findings("Skipped by --quick", ("vllm",))]
    # A probe that died before vLLM's line: the vLLM check is the one that hung or crashed.
    died = _run(None)
    del died.results["multi_gpu"]
    died.returncode = -11
    assert probe_findings(died, Platform(), plan, (), ("vllm",))[-2].message.startswith("The environment's Python exited")


def test_which_plans_bring_the_vllm_check():
    assert opt_in_checks({"vllm": VLLM.to_json()}) == ("vllm",)
    assert opt_in_checks({"vllm": Vllm("none", note="refused").to_json()}) == ()
    assert opt_in_checks({"torch": {}}) == () and opt_in_checks(None) == ()


# --- through `unsloth doctor` on a managed environment ------------------------------------------------

def managed_env(home: Path, plan: dict, *, torch_pin: str | None = None) -> Path:
    """A managed environment whose Python sees this venv's packages (torch) through a .pth file, with a
    fake vLLM in its own site-packages, and a receipt whose plan is ``plan``."""
    from unsloth.envs.receipt import Receipt, write_receipt

    env = home / "envs" / "e1"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "parent.pth").write_text(sysconfig.get_path("purelib") + "\n")
    fake_vllm(site, torch_pin=torch_pin or TORCH.split("+")[0])
    write_receipt(env, Receipt("e1", finished="2026-12-01T00:00:00+00:00", plan=plan))
    (home / "current").write_text("e1\n")
    return env


def doctor(home: Path, *args: str) -> dict:
    env = {**os.environ, "UNSLOTH_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "unsloth.cli", "doctor", "--json", *args], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.stdout, done.stderr
    return {finding["id"]: finding for finding in json.loads(done.stdout)["findings"]}


@pytest.mark.skipif(os.name != "posix", reason="POSIX venv layout")
def test_quick_doctor_lists_vllm_only_for_an_environment_installed_with_it(tmp_path):
    managed_env(tmp_path / "a", {"torch": {"backend": "cpu"}, "vllm": VLLM.to_json()})
    assert doctor(tmp_path / "a", "--quick")["env-vllm"]["status"] == "skipped"
    managed_env(tmp_path / "b", {"torch": {"backend": "cpu"}})  # its site-packages hold vLLM, its plan did not
    assert "env-vllm" not in doctor(tmp_path / "b", "--quick")


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="POSIX venv layout")
def test_doctor_checks_the_vllm_the_install_put_in(tmp_path):
    """The whole self-test in the environment's own Python (run_env_probe passes it `--with=vllm`):
    vLLM's line, judged, next to the others."""
    managed_env(tmp_path / "good", {"torch": {"backend": "cpu"}, "vllm": VLLM.to_json()})
    good = doctor(tmp_path / "good")["env-vllm"]
    assert good["status"] == "ok" and good["message"].startswith("vLLM 0.32.0 imports, built for torch")
    managed_env(tmp_path / "bad", {"torch": {"backend": "cpu"}, "vllm": VLLM.to_json()}, torch_pin="2.12.1")
    bad = doctor(tmp_path / "bad")["env-vllm"]
    assert bad["status"] == "error" and f"built for torch 2.12.1, but torch {TORCH} is installed" in bad["message"]

