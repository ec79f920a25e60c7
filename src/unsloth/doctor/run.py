"""`unsloth doctor` end to end: detect (or read a dump), plan, gather live facts, run every check.

The order is the order of the report: the machine first (GPU, driver, runtime, access), then
resources, then the managed environment and what its Python can do, which is the slow part.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from unsloth.doctor import checks
from unsloth.doctor.env_checks import EnvTarget, check_env
from unsloth.doctor.findings import Finding, summarize
from unsloth.doctor.host import HostFacts, gather_host_facts
from unsloth.envs.paths import active_env, env_python, home
from unsloth.envs.receipt import read_receipt
from unsloth.matrix import MatrixError, load_matrix
from unsloth.plan import Overrides, Plan, resolve
from unsloth.selftest.judge import opt_in_checks, probe_findings, skipped_env_findings
from unsloth.selftest.run import DEFAULT_TIMEOUT_S, run_env_probe
from unsloth.platform.facts import Platform

JSON_SCHEMA = 1
CRASH_FIX = "This is a bug in unsloth: report it with `unsloth doctor --verbose --dump ./unsloth-dump` attached"
T = TypeVar("T")


@dataclass
class Report:
    findings: list[Finding]
    platform: Platform
    plan: Plan | None
    source: str  # "live" or the dump directory
    timings: dict[str, float] = field(default_factory=dict)  # step -> seconds

    def summary(self) -> dict[str, Any]:
        return summarize(self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA,
            "source": self.source,
            "findings": [finding.to_json() for finding in self.findings],
            "platform": self.platform.to_json(),
            "plan": self.plan.to_json() if self.plan is not None else None,
            "summary": self.summary(),
            "timings": {step: round(seconds, 3) for step, seconds in self.timings.items()},
        }


def crashed(check_id: str, title: str, exc: BaseException) -> Finding:
    """A check that raised: an error finding with its traceback, so the rest of the report still prints."""
    return Finding(check_id, title, "error", f"The check crashed ({type(exc).__name__}: {exc})".replace("\n", " "),
                   fix=CRASH_FIX, detail="".join(traceback.format_exception(exc)).rstrip())


def guard(check_id: str, title: str, check: Callable[[], T]) -> T | Finding:
    """``check()``, or the finding that says it crashed. Every check runs through here."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        return crashed(check_id, title, exc)


def _listed(check_id: str, title: str, check: Callable[[], list[Finding]]) -> list[Finding]:
    found = guard(check_id, title, check)
    return [found] if isinstance(found, Finding) else found


def machine_findings(platform: Platform, plan: Plan | None, plan_error: Exception | str | None,
                     needs: checks.Needs, host: HostFacts | None, env_installed: bool) -> list[Finding]:
    """Every check that needs no environment, in report order; checks that do not apply drop out."""
    found = [
        guard("gpu", "GPU", lambda: checks.check_gpu(platform, plan)),
        guard("support", "Support", lambda: checks.check_support(plan, plan_error)),
        guard("driver", "GPU driver", lambda: checks.check_driver(platform, plan, needs)),
        guard("runtime", "GPU runtime", lambda: checks.check_runtime(platform, plan, needs)),
        guard("wsl-bridge", "WSL GPU bridge", lambda: checks.check_wsl_bridge(platform, plan, host)),
        guard("dev-kfd", "/dev/kfd access", lambda: checks.check_kfd_access(platform, plan, host)),
        guard("dev-dri", "/dev/dri access", lambda: checks.check_dri_access(platform, plan, host)),
        guard("hsa-override", "HSA_OVERRIDE_GFX_VERSION", lambda: checks.check_hsa_override(platform, plan, host)),
        guard("multi-gpu", "Several GPUs", lambda: checks.check_multi_gpu(platform, host)),
        guard("ram", "Memory", lambda: checks.check_ram(platform)),
        guard("disk", "Free disk", lambda: checks.check_disk(plan, host, env_installed)),
    ]
    found = [finding for finding in found if finding is not None]
    judged = {finding.id for finding in found if finding.status != "skipped"}
    advice = _listed("plan-advice", "Install plan", lambda: checks.check_plan_advice(plan, judged))
    return found[:2] + advice + found[2:]


def find_env_target(python: Path | None) -> EnvTarget | None:
    """--python wins; otherwise the active managed environment, if one finished installing."""
    if python is not None:
        # Absolute, so it still names the same file from the probe's own folder; not resolved,
        # because a venv's python is a symlink whose target knows nothing of the venv.
        found = shutil.which(python) if len(python.parts) == 1 else None  # a bare name: look on PATH
        return EnvTarget(python=Path(found or python).absolute(), origin="--python")
    env = active_env()
    if env is None:
        return None
    return EnvTarget(python=env_python(env), origin="managed", env=env, receipt=read_receipt(env))


def plan_for(platform: Platform, live: bool) -> tuple[Plan | None, Exception | None, checks.Needs]:
    """The plan, or the error that stopped it (an unreadable matrix; a crash in the planner is a bug)."""
    try:
        matrix = load_matrix()
        overrides = Overrides.from_env(os.environ) if live else None
        plan = resolve(platform, matrix, overrides=overrides)
        return plan, None, checks.needs_from_matrix(matrix, platform, plan)
    except MatrixError as exc:
        return None, exc, checks.Needs()
    except Exception as exc:  # noqa: BLE001 - reported by the support check, with its traceback
        return None, exc, checks.Needs()


def diagnose(platform: Platform, *, source: str = "live", python: Path | None = None, env_checks: bool = True,
             timeout_s: float = DEFAULT_TIMEOUT_S, timings: dict[str, float] | None = None) -> Report:
    """All findings for a detected platform. ``source`` is "live", or the dump directory it came from."""
    live = source == "live"
    timings = dict(timings or {})
    start = time.monotonic()
    plan, plan_error, needs = plan_for(platform, live)
    timings["plan"] = time.monotonic() - start

    start = time.monotonic()
    target = find_env_target(python) if live else None
    host = gather_host_facts(home()) if live else None
    managed = target is not None and target.origin == "managed"
    findings = machine_findings(platform, plan, plan_error, needs, host, env_installed=managed)
    env_finding = (guard("env", "Managed environment", lambda: check_env(target, platform)) if live else
                   Finding("env", "Managed environment", "skipped", checks.NOT_LIVE))
    findings.append(env_finding)
    timings["machine checks"] = time.monotonic() - start

    # vLLM's check runs where the install put it in (`--with vllm`, in the receipt's plan), else none is shown.
    with_checks = opt_in_checks(target.receipt.plan) if target is not None and target.receipt else ()
    if not live:
        findings += skipped_env_findings(checks.NOT_LIVE)
    elif target is None:
        findings += skipped_env_findings("No managed environment to check (run `unsloth install`)")
    elif not env_checks:
        findings += skipped_env_findings("Skipped by --quick", with_checks)
    elif env_finding.fails:
        findings += skipped_env_findings("The environment is broken (see above)", with_checks)
    else:
        start = time.monotonic()

        def environment_checks() -> list[Finding]:
            run = run_env_probe(target.python, checks.backend(plan), timeout_s, plan.env if plan else None,
                                with_checks)
            without = (target.receipt.without if target.receipt else None) or ()
            return probe_findings(run, platform, plan, without, with_checks)

        findings += _listed("env-checks", "Environment checks", environment_checks)
        timings["environment checks"] = time.monotonic() - start
    return Report(findings, platform, plan, source, timings)
