"""`unsloth doctor` end to end: detect (or read a dump), plan, gather live facts, run every check.

The order is the order of the report: the machine first (GPU, driver, runtime, access), then
resources, then the managed environment and what its Python can do, which is the slow part.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unsloth.doctor import checks
from unsloth.doctor.env_checks import (
    DEFAULT_TIMEOUT_S,
    EnvTarget,
    check_env,
    probe_findings,
    run_env_probe,
    skipped_env_findings,
)
from unsloth.doctor.findings import Finding, summarize
from unsloth.doctor.host import HostFacts, gather_host_facts
from unsloth.envs.paths import active_env, env_python, home
from unsloth.envs.receipt import read_receipt
from unsloth.matrix import MatrixError, load_matrix
from unsloth.plan import Overrides, Plan, resolve
from unsloth.platform.facts import Platform

JSON_SCHEMA = 1


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


def machine_findings(platform: Platform, plan: Plan | None, plan_error: str | None, needs: checks.Needs,
                     host: HostFacts | None, env_installed: bool) -> list[Finding]:
    """Every check that needs no environment, in report order; checks that do not apply drop out."""
    found = [
        checks.check_gpu(platform, plan),
        checks.check_support(plan, plan_error),
        checks.check_driver(platform, plan, needs),
        checks.check_runtime(platform, plan, needs),
        checks.check_wsl_bridge(platform, plan, host),
        checks.check_kfd_access(platform, plan, host),
        checks.check_dri_access(platform, plan, host),
        checks.check_hsa_override(platform, plan, host),
        checks.check_multi_gpu(platform, host),
        checks.check_ram(platform),
        checks.check_disk(plan, host, env_installed),
    ]
    found = [finding for finding in found if finding is not None]
    judged = {finding.id for finding in found if finding.status != "skipped"}
    return found[:2] + checks.check_plan_advice(plan, judged) + found[2:]


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


def plan_for(platform: Platform, live: bool) -> tuple[Plan | None, str | None, checks.Needs]:
    try:
        matrix = load_matrix()
        overrides = Overrides.from_env(os.environ) if live else None
        plan = resolve(platform, matrix, overrides=overrides)
    except MatrixError as exc:
        return None, str(exc), checks.Needs()
    return plan, None, checks.needs_from_matrix(matrix, platform, plan)


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
    env_finding = (check_env(target, platform) if live else
                   Finding("env", "Managed environment", "skipped", checks.NOT_LIVE))
    findings.append(env_finding)
    timings["machine checks"] = time.monotonic() - start

    if not live:
        findings += skipped_env_findings(checks.NOT_LIVE)
    elif target is None:
        findings += skipped_env_findings("No managed environment to check (run `unsloth install`)")
    elif not env_checks:
        findings += skipped_env_findings("Skipped by --quick")
    elif env_finding.fails:
        findings += skipped_env_findings("The environment is broken (see above)")
    else:
        start = time.monotonic()
        run = run_env_probe(target.python, checks.backend(plan), timeout_s, plan.env if plan else None)
        without = (target.receipt or {}).get("without") or ()
        findings += probe_findings(run, platform, plan, without)
        timings["environment checks"] = time.monotonic() - start
    return Report(findings, platform, plan, source, timings)
