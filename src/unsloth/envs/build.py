"""Build one environment beside the current one, verify it, and write its receipt.

Either the build finishes with a receipt, or its folder is deleted (failure, Ctrl-C, SIGTERM).
A SIGKILL can leave a folder without a receipt; the next run sweeps it away under the lock.
Nothing here touches the active environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from rich.console import Console
from rich.markup import escape

from unsloth import __version__
from unsloth.envs import steps as plan_steps
from unsloth.envs.paths import CACHE, build_caches, env_python, env_scripts, envs_dir, home
from unsloth.envs.receipt import Receipt, digest, hardware_fingerprint, read_receipt, utc_now, write_receipt
from unsloth.envs.runner import Step, StepFailed, run_step
from unsloth.envs.sources import TORCH_FAMILY, local_listings, torch_source
from unsloth.envs.steps import Request, Tool
from unsloth.envs.verify import problems
from unsloth.errors import UnslothError
from unsloth.selftest.judge import opt_in_checks, probe_findings
from unsloth.selftest.parse import parse_probe_output, verification
from unsloth.selftest.run import copy_script, run_env_probe
from unsloth.selftest.script import IMPORTS

TRAIN_IMPORTS = ["transformers", "peft", "trl", "accelerate", "datasets"]


class BuildFailed(UnslothError):
    """The new environment does not fit the plan; it has been removed, the active one is untouched."""

    def __init__(self, message: str, found: list[str], fix: str, log: Path | None = None):
        super().__init__(message, fix)
        self.found, self.log = found, log


def find_uv() -> str | None:
    """uv from UNSLOTH_UV, the running environment (the `uv` package), the bootstrap environment, or PATH."""
    if os.environ.get("UNSLOTH_UV"):
        return os.environ["UNSLOTH_UV"]
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    name = "uv.exe" if os.name == "nt" else "uv"
    for candidate in (Path(sys.executable).parent / name, env_scripts(home() / "bootstrap") / name):
        if candidate.exists():
            return str(candidate)
    return shutil.which("uv")


def default_python() -> str:
    """The interpreter this installer runs on, outside any virtual environment."""
    return getattr(sys, "_base_executable", None) or sys.executable


def request_hash(request: Request, plan_json: dict[str, Any], source_id: str, fingerprint: str) -> str:
    """Same hash, same environment: a re-run with nothing new has nothing to do."""
    return digest(
        {"request": request.to_json(), "plan": plan_json, "source_id": source_id, "fingerprint": fingerprint, "unsloth": __version__}
    )


def source_identity(source: str) -> str:
    """What identifies the package source: an archive's URL, or the content of a directory's package files."""
    if not plan_steps.is_local_source(source):
        return source
    root = Path(source.removeprefix("file://"))
    files = [root / "pyproject.toml"] + sorted(
        path for top in ("src", "kernels") if (root / top).is_dir() for path in (root / top).rglob("*") if path.is_file()
    )
    entries = [
        (str(path.relative_to(root)), hashlib.sha256(path.read_bytes()).hexdigest())
        for path in files
        if path.is_file() and "__pycache__" not in path.parts and not any(p.endswith(".egg-info") for p in path.parts)
    ]
    return digest(entries)


def new_env_name() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


QUERY_TIMEOUT_S = 120  # a query in the new interpreter imports only the standard library


def _json_from(python: Path, code: str) -> Any:
    """Run ``code`` in the new environment's interpreter and read the JSON it prints. A broken
    interpreter is a BuildFailed (the build is removed, the user told why), never a traceback."""
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                             timeout=QUERY_TIMEOUT_S)
        return json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise BuildFailed(f"the new environment's Python ({python}) did not answer", [detail.strip()[-2000:]],
                          "Check that the interpreter given with --python works (`PYTHON -c 'import json'`), "
                          "then run `unsloth install` again.") from exc


def installed_versions(python: Path) -> dict[str, str]:
    return _json_from(
        python,
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions() if d.metadata['Name']}))",
    )


def build(
    root: Path,
    request: Request,
    plan,
    platform,
    console: Console,
    *,
    use_pip: bool = False,
    doctor_checks: bool = True,
) -> Path:
    """Build, verify and receipt a new environment under ``root``/envs; return its path.

    ``doctor_checks=False`` skips doctor's live GPU operations (for tests whose torch is a stand-in)."""
    env = envs_dir(root) / new_env_name()
    started = utc_now()
    try:
        return _build(env, request, plan, platform, console, use_pip, started, doctor_checks)
    except BaseException as exc:
        kept = keep_logs(root, env)
        if kept and isinstance(exc, (StepFailed, BuildFailed)):
            exc.log = kept / exc.log.name if exc.log else kept
        shutil.rmtree(env, ignore_errors=True)
        raise


FAILED_LOGS_KEPT = 3


def step_env(root: Path, request: Request, step: Step) -> dict[str, str | None]:
    """An install step's variables: our sources only, nothing pip or uv adds; downloads and built wheels
    in our caches (the step's own, such as a source build's per-plan cache, win)."""
    return {**build_caches(root), **request.sources.env(os.environ), **step.env}


def keep_logs(root: Path, env: Path) -> Path | None:
    """Move a failed build's logs to <home>/logs/<name> (the build itself is deleted); keep the last few."""
    logs = env / "logs"
    if not logs.is_dir():
        return None
    target = root / "logs" / env.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(logs), str(target))
    for old in sorted(target.parent.iterdir())[:-FAILED_LOGS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _build(
    env: Path, request: Request, plan, platform, console: Console, use_pip: bool, started: str, doctor_checks: bool
) -> Path:
    platform_json = platform.to_json()
    logs = env / "logs"
    python = env_python(env)
    base_python = request.python or default_python()
    uv = None if use_pip else find_uv()
    count = iter(range(1, 100))

    def run(step: Step) -> str:
        step.env = step_env(env.parent.parent, request, step)
        return run_step(step, logs, console, next(count))

    env.mkdir(parents=True)
    if uv:
        run(Step("venv", f"Python environment ({base_python})", [uv, "venv", "--allow-existing", "--python", base_python, str(env)]))
        tool = Tool.uv(uv, python)
    else:
        run(Step("venv", f"Python environment ({base_python})", [base_python, "-m", "venv", str(env)]))
        tool = Tool.pip(python)

    info = _json_from(python, "import sys, json; print(json.dumps([sys.version.split()[0], f'cp{sys.version_info[0]}{sys.version_info[1]}']))")
    py_version, py_tag = info
    _check_python_for_vllm(plan, py_version, base_python)
    torch = torch_source(plan.torch, request.sources, py_tag, local_listings(request.sources.find_links), request.torch_index_url)
    run(plan_steps.torch_step(tool, torch, request.sources, plan.torch.backend))

    pins = env / "unsloth-pins.txt"
    pins.write_text(plan_steps.pins_text(installed_versions(python), TORCH_FAMILY), encoding="utf-8")
    run(plan_steps.packages_step(tool, request, pins, plan.bitsandbytes, plan.vllm))
    export_requires = _export_requires(python)
    export = plan_steps.export_step(tool, request, pins, export_requires)
    if export:
        run(export)
    optional_failed = {}
    cache = env.parent.parent / CACHE
    llama = plan_steps.llama_cpp_step(tool, request, pins, export_requires, plan.llama_cpp, cache=cache)
    if llama:
        try:
            try:
                run(llama)
                if "--no-deps" in llama.argv:  # prebuilt: now its dependencies, with it pinned
                    pins.write_text(plan_steps.pins_text(installed_versions(python), TORCH_FAMILY | {"llama-cpp-python"}),
                                    encoding="utf-8")
                    run(plan_steps.llama_cpp_deps_step(tool, request, pins, export_requires))
            except StepFailed as exc:
                if "--no-deps" not in llama.argv:
                    raise
                # The prebuilt index could not serve it (offline, a mirror, no wheel for this Python):
                # build it from the general sources with the plan's CMAKE_ARGS instead.
                console.print(f"[yellow]! {escape(exc.step.title)} failed[/]; building it from source instead. "
                              f"Log: {escape(str(exc.log))}")
                run(plan_steps.llama_cpp_step(tool, request, pins, export_requires, plan.llama_cpp, cache=cache,
                                              prebuilt=False))
        except StepFailed as exc:  # optional: training works without it; doctor says how to add it
            _without_it(console, exc, optional_failed, "llama-cpp")
    pins_all = env / "unsloth-pins-all.txt"
    fla = plan_steps.fla_step(tool, request, pins_all, plan.flash_linear_attention)
    if fla:
        installed = installed_versions(python)
        pins_all.write_text(plan_steps.pins_text(installed, frozenset(installed)), encoding="utf-8")
        try:
            run(fla)
        except StepFailed as exc:  # an accelerator: our torch chunked rule runs those layers without it
            _without_it(console, exc, optional_failed, "fla")

    probe = _verify(run, python, plan, request, optional_failed, logs)
    if doctor_checks:
        _doctor_checks(python, plan, platform, request, logs, console)
    receipt = Receipt(
        name=env.name,
        created=started,
        finished=utc_now(),
        unsloth={"version": probe["packages"].get(plan_steps.DIST_NAME), "source": request.source},
        request=request.to_json(),
        request_hash=request_hash(
            request, plan.to_json(), source_identity(request.source), hardware_fingerprint(platform_json)
        ),
        fingerprint=hardware_fingerprint(platform_json),
        platform=platform_json,
        plan=plan.to_json(),
        python={"version": py_version, "executable": str(python)},
        installer={"tool": tool.name, "version": _tool_version(tool)},
        indexes={"torch": torch.to_json(), **request.sources.to_json()},
        without=sorted(request.without),
        optional_failed=optional_failed,
        packages=probe["packages"],
        verified={**probe["torch"], "imports": probe["imports"]},
    )
    write_receipt(env, receipt)
    return env


def _without_it(console: Console, exc: StepFailed, optional_failed: dict[str, str], part: str) -> None:
    """An optional part failed: say so, record its log in the receipt, and go on."""
    console.print(f"[yellow]! {escape(exc.step.title)} failed[/]; continuing without it. "
                  f"Log: {escape(str(exc.log))}\n  {escape(exc.fix)}")
    optional_failed[part] = str(exc.log)


def _verify(run, python: Path, plan, request: Request, optional_failed: dict[str, str], logs: Path) -> dict[str, Any]:
    required = ["unsloth"] + ([] if "train" in request.without else TRAIN_IMPORTS)
    if plan.bitsandbytes.available and "bitsandbytes" not in request.without:
        required.append("bitsandbytes")
    if not {"export", "llama-cpp"} & (set(request.without) | set(optional_failed)):
        required.append("llama_cpp")
    if plan.vllm is not None and plan.vllm.available:
        required.append("vllm")
    fla = plan.flash_linear_attention
    if fla is not None and fla.available and "fla" not in set(request.without) | set(optional_failed):
        required.append("fla")
    script = copy_script(logs)
    probe_step = Step("verify", "Verify: imports, the torch build, the GPU",
                      [str(python), str(script), "--backend", plan.torch.backend, "--only", "torch", "--imports", *IMPORTS])
    output = run(probe_step)
    results = parse_probe_output(output)
    if "packages" not in results:  # it prints its packages last
        raise BuildFailed("the verify step printed no result", [output.strip()[-2000:] or "(no output)"],
                          "See the verify log; `unsloth install --force` builds again from scratch.")
    probe = verification(results)
    found = problems(plan.torch.backend, probe, required)
    if found:
        wrong_torch = any(problem.startswith("torch ") for problem in found)
        fix = (f"PyTorch must come from the plan's index ({plan.torch.index_url}) or a mirror of it: "
               "unsloth install --torch-index-url <that mirror>") if wrong_torch else (
               "See the verify log for the failing import; `unsloth install --force` builds again from scratch.")
        raise BuildFailed("the new environment does not match the plan", found, fix)
    return probe


def _doctor_checks(python: Path, plan, platform, request: Request, logs: Path, console: Console) -> None:
    """doctor's environment checks (a real matmul, bitsandbytes, Triton, llama.cpp) must not fail."""
    with console.status("Doctor's environment checks"):
        with_checks = opt_in_checks(plan.to_json())
        run = run_env_probe(python, plan.torch.backend, with_checks=with_checks)
    findings = probe_findings(run, platform, plan, request.without, with_checks)
    (logs / "doctor.json").write_text(json.dumps([f.to_json() for f in findings], indent=2), encoding="utf-8")
    failed = [f for f in findings if f.fails]
    if failed:
        fixes = "; ".join(dict.fromkeys(f.fix for f in failed if f.fix)) or "see logs/doctor.json"
        raise BuildFailed("doctor's environment checks failed in the new environment",
                          [f"{f.title}: {f.message}" for f in failed], fixes)
    console.print(f"[green]✓[/] Doctor's environment checks [dim]({run.seconds:.1f}s)[/]")


def _check_python_for_vllm(plan, py_version: str, base_python: str) -> None:
    """vLLM's wheels install on some Pythons only: say so before minutes of downloads, not in uv's words."""
    vllm = plan.vllm
    if vllm is None or not vllm.available or not vllm.python:
        return
    if not SpecifierSet(vllm.python).contains(py_version):
        raise BuildFailed(f"{vllm.spec} installs on Python {vllm.python}, and this environment's Python "
                          f"({base_python}) is {py_version}", [f"--with vllm needs Python {vllm.python}"],
                          "Pass a Python it installs on, e.g. `unsloth install --with vllm --python python3.12`, "
                          "or leave out --with vllm")


def _requires(python: Path) -> list[str]:
    """This package's requirements (all extras, with their markers), as installed in ``python``'s environment."""
    return _json_from(
        python, f"import importlib.metadata as m, json; print(json.dumps(m.requires({plan_steps.DIST_NAME!r}) or []))")


def _export_requires(python: Path) -> list[str]:
    """The ``export`` extra's requirements, read from the package installed in ``python``'s environment."""
    return [r for r in _requires(python) if 'extra == "export"' in r]


def _own_requirements(requires: list[str], request: Request) -> list[str]:
    """What installing this package (with ``train`` unless left out) asks for, without the package itself."""
    extras = set() if "train" in request.without else {"train"}
    wanted = []
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            wanted.append(text)
        elif any(req.marker.evaluate({"extra": extra}) for extra in extras):
            req.marker = None
            wanted.append(str(req))
    return wanted


NEWER_CHECK_TIMEOUT_S = 600


def has_newer(env: Path, request: Request, plan) -> bool | None:
    """Would building now install anything ``env`` does not have? Asked of uv without building
    anything: each install step against ``env`` itself, with ``--dry-run --upgrade``. None when it
    cannot tell (no uv, a query that failed): then the caller builds and compares, as before."""
    uv, python, pins = find_uv(), env_python(env), env / "unsloth-pins.txt"
    receipt = read_receipt(env)
    version = ((receipt.python if receipt else {}).get("version") or "").split(".")
    if uv is None or not python.exists() or not pins.is_file() or len(version) < 2:
        return None
    tool = Tool.uv(uv, python)
    try:
        requires = _requires(python)
    except BuildFailed:
        return None
    export_requires = [r for r in requires if 'extra == "export"' in r]
    torch = torch_source(plan.torch, request.sources, f"cp{version[0]}{version[1]}",
                         local_listings(request.sources.find_links), request.torch_index_url)
    steps = [plan_steps.torch_step(tool, torch, request.sources, plan.torch.backend),
             plan_steps.packages_step(tool, request, pins, plan.bitsandbytes, plan.vllm),
             plan_steps.export_step(tool, request, pins, export_requires),
             plan_steps.llama_cpp_step(tool, request, pins, export_requires, plan.llama_cpp,
                                       cache=env.parent.parent / CACHE),
             plan_steps.fla_step(tool, request, pins, plan.flash_linear_attention)]
    for step in filter(None, steps):
        argv = [arg for arg in step.argv if arg != "--verbose"]
        if step.name == "packages":
            # Our own package is in the request hash (its source's content); uv would always reinstall a
            # local one under --upgrade, so ask about what it requires instead.
            if "--reinstall-package" in argv:
                at = argv.index("--reinstall-package")
                del argv[at:at + 2]
            argv = [arg for arg in argv if not arg.startswith(plan_steps.DIST_NAME)]
            argv += _own_requirements(requires, request)
        environ = {**os.environ, **step_env(env.parent.parent, request, step)}
        try:
            done = subprocess.run([*argv, "--dry-run", "--upgrade"], capture_output=True, text=True,
                                  timeout=NEWER_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL,
                                  env={k: v for k, v in environ.items() if v is not None})
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        if "Would make no changes" not in done.stdout + done.stderr:
            return True
    return False


def _tool_version(tool: Tool) -> str:
    argv = [tool.install[0], "--version"] if tool.name == "uv" else [tool.install[0], "-m", "pip", "--version"]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


__all__ = ["BuildFailed", "StepFailed", "build", "find_uv", "has_newer", "request_hash", "source_identity"]
