"""The import graph runs one way: kernels <- models <- training / export <- notebook <- commands.

Read from the source (every import statement, including those inside functions), so a new arrow
running back up a layer fails here rather than in a reviewer's head.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "unsloth"
KERNELS = ROOT / "kernels" / "unsloth_kernels"

# package (or module) -> packages it must never import
FORBIDDEN = {
    "unsloth_kernels": ["unsloth"],
    "unsloth.errors": ["unsloth"],
    "unsloth.logs": ["unsloth"],
    "unsloth.models": ["unsloth.training", "unsloth.export", "unsloth.notebook", "unsloth.commands", "unsloth.cli"],
    "unsloth.training": ["unsloth.notebook", "unsloth.commands", "unsloth.cli"],
    "unsloth.export": ["unsloth.training", "unsloth.notebook", "unsloth.commands", "unsloth.cli"],
    "unsloth.notebook": ["unsloth.commands", "unsloth.cli"],
    "unsloth.platform": ["unsloth.plan", "unsloth.selftest", "unsloth.envs", "unsloth.doctor", "unsloth.commands",
                         "unsloth.models"],
    "unsloth.matrix": ["unsloth.plan", "unsloth.selftest", "unsloth.envs", "unsloth.doctor", "unsloth.commands"],
    "unsloth.plan": ["unsloth.selftest", "unsloth.envs", "unsloth.doctor", "unsloth.commands"],
    # the environment self-test, below both the install (which verifies with it) and doctor
    "unsloth.selftest": ["unsloth.envs", "unsloth.doctor", "unsloth.commands", "unsloth.cli"],
    "unsloth.envs": ["unsloth.doctor", "unsloth.commands"],
    "unsloth.doctor": ["unsloth.commands"],
}


def _module_name(path: Path) -> str:
    if path.is_relative_to(KERNELS):
        rel = path.relative_to(KERNELS.parent)
    else:
        rel = path.relative_to(SRC.parent)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return _imported_names(path.read_text(), package)


def _imported_names(source: str, package: str) -> set[str]:
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _sources():
    return sorted([*SRC.rglob("*.py"), *KERNELS.rglob("*.py")])


def test_the_walk_finds_the_layers():
    modules = {_module_name(p) for p in _sources()}
    for layer in FORBIDDEN:
        assert any(_within(m, layer) for m in modules), f"no module of {layer}: the layer table is stale"


def _violations(module: str, names: set[str]) -> list[str]:
    return [f"{module} imports {name} ({layer} must not import {bad})"
            for layer, above in FORBIDDEN.items() if _within(module, layer)
            for name in sorted(names) for bad in above if _within(name, bad)]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_up_a_layer(path):
    wrong = _violations(_module_name(path), _imports(path))
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("source", [
    "def f():\n    from unsloth.training.sft import train\n",   # inside a function
    "from ...export import gguf\n",                            # relative, from unsloth.models.patches
    "import unsloth.notebook.fast_model\n",
])
def test_the_checker_sees_an_upward_import(source):
    names = _imported_names(source, "unsloth.models.patches")
    assert _violations("unsloth.models.patches.lora", names)


def test_the_checker_allows_a_downward_import():
    names = _imported_names("from unsloth.models.merge import merged_tensors\nimport unsloth_kernels\n", "unsloth.export")
    assert not _violations("unsloth.export.gguf", names)


# Commands return results; unsloth.commands.render prints them (and is the echo for streamed replies and
# the console long jobs report on). So no other module under unsloth.commands writes output itself.
PRINTER = "unsloth.commands.render"


def _direct_output(source: str) -> list[str]:
    """Each place ``source`` writes output itself: print(), <anything>.print(), sys.stdout / sys.stderr
    .write(), a rich Console, or doctor's table printers (which the renderer calls)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                found.append(f"line {node.lineno}: print()")
            elif isinstance(func, ast.Attribute) and func.attr == "print":
                found.append(f"line {node.lineno}: .print()")
            elif (isinstance(func, ast.Attribute) and func.attr in ("write", "writelines")
                  and isinstance(func.value, ast.Attribute) and func.value.attr in ("stdout", "stderr")):
                found.append(f"line {node.lineno}: {func.value.attr}.{func.attr}()")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = _imported_names(ast.unparse(node), "unsloth.commands")
            for printer in ("rich.console", "unsloth.doctor.render"):
                if any(_within(name, printer) for name in names):
                    found.append(f"line {node.lineno}: imports {printer}")
    return found


def _command_modules():
    return [p for p in _sources() if _within(_module_name(p), "unsloth.commands") and _module_name(p) != PRINTER]


def test_the_command_modules_are_found():
    assert {"unsloth.commands.detect", "unsloth.commands.install", "unsloth.commands.chat"} <= {
        _module_name(p) for p in _command_modules()}


@pytest.mark.parametrize("path", _command_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_print_only_through_the_renderer(path):
    found = _direct_output(path.read_text())
    assert not found, f"{_module_name(path)} prints itself; return a result (unsloth.commands.results) or " \
                      f"use {PRINTER}.echo:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "print('done')\n",
    "import sys\ndef f():\n    sys.stderr.write('x')\n",
    "def f(console):\n    console.print('[green]Ready[/]')\n",
    "from rich.console import Console\n",
    "import rich.console\n",
    "def f():\n    from unsloth.doctor import render\n",
])
def test_the_print_check_sees_direct_output(source):
    assert _direct_output(source)


def test_the_print_check_allows_the_renderer_and_reading_the_terminal():
    source = ("import sys\nfrom unsloth.commands import render\n"
              "def f(console):\n    render.echo('x', end='')\n    console.input('ok? ')\n    sys.stdout.isatty()\n")
    assert not _direct_output(source)


# unsloth.envs (install, update, rollback, uninstall) hands back outcomes (unsloth.envs.outcomes) and says
# what it is doing only on the progress console the command hands it: it never prints, writes to a
# standard stream, or makes a console of its own.
def _own_output(source: str) -> list[str]:
    found = [line for line in _direct_output(source) if not line.endswith((": .print()", "imports rich.console"))]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "Console":
                found.append(f"line {node.lineno}: Console()")
    return found


def _env_modules():
    return [p for p in _sources() if _within(_module_name(p), "unsloth.envs")]


def test_the_env_modules_are_found():
    assert {"unsloth.envs.manager", "unsloth.envs.build", "unsloth.envs.runner"} <= {
        _module_name(p) for p in _env_modules()}


@pytest.mark.parametrize("path", _env_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_envs_print_only_on_the_progress_console_it_is_handed(path):
    found = _own_output(path.read_text())
    assert not found, f"{_module_name(path)} prints itself; return an outcome (unsloth.envs.outcomes) or say " \
                      "it on the console the command hands in:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "print('Ready')\n",
    "import sys\ndef f():\n    sys.stdout.write('x')\n",
    "from rich.console import Console\ndef f():\n    Console().print('x')\n",
    "import rich.console\nc = rich.console.Console(stderr=True)\n",
    "def f():\n    from unsloth.doctor import render\n",
])
def test_the_env_print_check_sees_output_of_its_own(source):
    assert _own_output(source)


def test_the_env_print_check_allows_the_handed_console():
    source = ("from rich.console import Console\n"
              "def build(console: Console):\n    console.print('building')\n    with console.status('x'):\n        pass\n")
    assert not _own_output(source)


# The README's layout table is the map a newcomer reads first: every folder and module at the top of
# the repository and of the package has a row (or is named in one).
def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Layout\n", 1)[1].split("\n\n", 2)
    return next(part for part in table if part.lstrip().startswith("|"))


def _named(table: str, path: str) -> bool:
    spans = re.findall(r"`([^`]+)`", table)
    return any(span.rstrip("/") == path or span.startswith(path + "/") for span in spans)


def _tracked(folder: Path) -> list[str]:
    """The names in `folder` that the repository holds (not build outputs such as an editable
    install's egg-info, or caches); every name there when git cannot tell."""
    import subprocess

    done = subprocess.run(["git", "ls-files", "."], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return [p.name for p in folder.iterdir() if not p.name.endswith(".egg-info") and p.name != "__pycache__"]
    return sorted({line.split("/")[0] for line in done.stdout.splitlines()})


def test_the_readme_layout_table_names_every_top_level_part():
    table = _layout_table()
    top = [n for n in _tracked(ROOT) if not n.startswith(".") and n not in ("README.md", "pyproject.toml")]
    package = [n for n in _tracked(SRC) if n not in ("__init__.py", "__pycache__")]
    missing = [name for name in top if not _named(table, name)]
    missing += [f"src/unsloth/{name}" for name in package
                if not (_named(table, f"src/unsloth/{name}") or _named(table, name))]
    assert not missing, f"README.md's layout table has no row for {missing}"


def test_the_layout_check_sees_a_missing_row():
    assert _named("| `src/unsloth/envs/` | x |", "src/unsloth/envs") and _named("| `a.py`, `plan/` |", "plan")
    assert not _named("| `src/unsloth/envs/` | x |", "src/unsloth/plan")
