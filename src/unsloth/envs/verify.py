"""Does a built environment match its plan? Pure: the self-test's verification and the plan in, problems out."""

from __future__ import annotations

from unsloth.selftest.script import torch_backend


def problems(plan_backend: str, probe: dict, required_imports: list[str]) -> list[str]:
    """Everything that makes the environment unfit for the plan; empty when it is good to switch to."""
    found = []
    torch_info = probe.get("torch") or {}
    if "error" in torch_info:
        found.append(f"torch does not import: {torch_info['error']}")
    else:
        built_for = torch_backend(torch_info)
        expected = "cpu" if plan_backend == "mps" else plan_backend  # macOS torch reports no backend in its version
        if built_for != expected:
            found.append(
                f"torch {torch_info.get('version')} is a {built_for} build, but the plan needs {plan_backend}"
            )
        elif plan_backend != "cpu" and not torch_info.get("gpu_seen"):
            found.append(f"torch {torch_info.get('version')} is a {built_for} build but sees no GPU")
    for name in required_imports:
        status = (probe.get("imports") or {}).get(name)
        if status != "ok":
            found.append(f"{name} does not import: {status or 'not checked'}")
    return found
