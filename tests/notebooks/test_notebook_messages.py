"""What the loader says once reaches a notebook or a script that set up no logging, and stays out of the
way of logging that is set up."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (pytest itself sets up logging), our source first."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(SRC)!r})\n" + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, check=True)


def test_a_script_that_set_up_no_logging_sees_the_load_message():
    done = _run("""
        import logging
        logging.getLogger("unsloth").info("before the facade")  # dropped, as logging does
        import unsloth.notebook
        logging.getLogger("unsloth").info("unsloth: llama: family patches")
        logging.getLogger("unsloth.export.gguf").info("writing model.gguf")
        logging.getLogger("unsloth").debug("not at INFO")
        """)
    assert done.stderr.splitlines() == ["unsloth: llama: family patches", "writing model.gguf"]
    assert done.stdout == ""


def test_logging_set_up_later_prints_each_line_once():
    done = _run("""
        import logging
        import unsloth.notebook
        logging.basicConfig(format="root: %(message)s")
        logging.getLogger("unsloth").info("said once")
        logging.getLogger("unsloth").warning("warned once")
        """)
    assert done.stderr.splitlines() == ["root: said once", "root: warned once"]


def test_logging_set_up_before_is_left_alone():
    done = _run("""
        import logging
        logging.basicConfig(level=logging.WARNING, format="root: %(message)s")
        import unsloth.notebook
        logging.getLogger("unsloth").info("not shown: the application asked for warnings")
        logging.getLogger("unsloth").warning("shown")
        """)
    assert done.stderr.splitlines() == ["root: shown"]


def test_a_commands_handler_replaces_the_fallback():
    done = _run("""
        import logging
        import unsloth.notebook
        from unsloth.logs import log_handler, own_handlers
        log = logging.getLogger("unsloth")
        assert log.handlers and not own_handlers(log)
        log.addHandler(log_handler())  # what `unsloth train` does when nothing of its own is there
        log.info("once")
        """)
    assert done.stderr.splitlines() == ["once"]


def test_the_load_message_is_not_said_twice_when_lora_changes_nothing(caplog):
    from unsloth.models.patches import PatchReport

    report = PatchReport("llama", skipped="kernels off: reasons")
    with caplog.at_level(logging.INFO, logger="unsloth"):
        report.say()
        report.say()
        report.checkpointed = 2
        report.skipped = None
        report.say()
    lines = [r.getMessage() for r in caplog.records if r.name == "unsloth"]
    assert len(lines) == 2 and lines[0] != lines[1] and "checkpointing on 2 layers" in lines[1]
