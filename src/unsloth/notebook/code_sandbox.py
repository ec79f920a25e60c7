"""What the RL notebooks that reward generated code (Sudoku, 2048, matmul) import from unsloth.

    ok, info = check_python_modules(code)          # only standard-library imports?
    strategy = create_locked_down_function(code)   # the one function the code defines, with no globals

    @execute_with_time_limit(10)                   # TimeoutError after 10 seconds
    def play(strategy, game): ...

The lock-down keeps a generated function from reading the notebook's globals (numpy, the game,
the reward functions); it is no sandbox against hostile code, as in Unsloth.
"""

from __future__ import annotations

import ast
import functools
import signal
import sys
import threading
import types
from typing import Callable

__all__ = ["check_python_modules", "create_locked_down_function", "execute_with_time_limit"]


@functools.cache
def _stdlib() -> frozenset[str]:
    return frozenset(name.lower() for name in (*sys.stdlib_module_names, *sys.builtin_module_names, "__future__"))


def check_python_modules(code: str) -> tuple[bool, dict]:
    """(ok, info): ok when every absolute import of `code` is a standard-library module. info holds
    `stdlib` and `non_stdlib` (sorted top-level names), `relative_imports` (a count), and `error`
    where the code does not parse (then ok is False)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return False, {"error": f"SyntaxError: {e}", "stdlib": [], "non_stdlib": [], "relative_imports": 0}
    modules, relative = set(), 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                relative += 1
            elif node.module:
                modules.add(node.module.split(".")[0])
    stdlib = sorted(m for m in modules if m.lower() in _stdlib())
    others = sorted(m for m in modules if m.lower() not in _stdlib())
    return not others, {"stdlib": stdlib, "non_stdlib": others, "relative_imports": relative}


def create_locked_down_function(source: str) -> types.FunctionType:
    """The function `source` defines (one top-level def, a docstring allowed before it), bound to empty
    globals: it sees the builtins and its own imports, nothing of the caller's. ValueError when the
    source is not exactly one function or fails while defining it."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"the code does not parse: {e}") from e
    body = tree.body[1:] if tree.body and _is_docstring(tree.body[0]) else tree.body
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef):
        raise ValueError("the code must define exactly one top-level function and nothing else")
    if body[0].decorator_list:
        raise ValueError("a decorator runs code at definition time: define the function without one")
    namespace: dict = {}
    try:
        exec(compile(tree, "<generated>", "exec", dont_inherit=True), {}, namespace)
    except Exception as e:
        raise ValueError(f"defining the function failed: {type(e).__name__}: {e}") from e
    # Python gives a function with globals lacking __builtins__ the interpreter's builtins
    return types.FunctionType(namespace[body[0].name].__code__, {})


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def execute_with_time_limit(seconds: float) -> Callable[[Callable], Callable]:
    """A decorator: the call raises TimeoutError once it has run `seconds`. In the main thread of a
    Unix process an alarm interrupts the call itself; elsewhere (Windows, another thread) it runs in a
    worker thread that is abandoned, still running, when the time is up."""
    if not seconds > 0:
        raise ValueError(f"execute_with_time_limit: seconds must be > 0, got {seconds!r}")

    def decorator(function: Callable) -> Callable:
        @functools.wraps(function)
        def limited(*args, **kwargs):
            if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
                return _with_alarm(seconds, function, args, kwargs)
            return _in_thread(seconds, function, args, kwargs)

        return limited

    return decorator


def _with_alarm(seconds: float, function: Callable, args, kwargs):
    def expire(signum, frame):
        raise TimeoutError(f"timed out after {seconds:g} s")

    previous_handler = signal.signal(signal.SIGALRM, expire)
    previous_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return function(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_timer[0] > 0:  # an enclosing limit keeps counting
            signal.setitimer(signal.ITIMER_REAL, *previous_timer)


def _in_thread(seconds: float, function: Callable, args, kwargs):
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            outcome["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="unsloth-time-limit")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"timed out after {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
