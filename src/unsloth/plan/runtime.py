"""Runtime advice: what the machine must have beside the wheels (the ROCm kernel side, WSL's bridge),
and the environment variables that would mislead the runtime. Pure: facts in, env and notes out."""

from __future__ import annotations

from unsloth.plan.model import NO_NOTES, Inputs, Notes
from unsloth.plan.versions import gfx_of

def env_rows(inputs: Inputs, backend: str) -> tuple[dict[str, str], Notes]:
    """The matrix's environment rows for this backend on this OS."""
    env: dict[str, str] = {}
    notes = NO_NOTES
    for row in inputs.matrix.env:
        if row.backend == backend and inputs.os in row.oses:
            env.update(row.vars)
            notes = notes.cite(row.source)
    return env, notes


def rocm_present(inputs: Inputs) -> bool:
    """A ROCm version, or a ROCm tool that answered, shows ROCm is installed (even if its version is unknown)."""
    return inputs.platform.rocm_version is not None or bool(inputs.platform.rocm_installed)


def rocm_runtime(inputs: Inputs) -> tuple[dict[str, str], Notes]:
    """Linux/WSL ROCm wheels bundle their libraries but need the kernel side (and, on WSL, librocdxg)."""
    matrix, platform = inputs.matrix, inputs.platform
    newest = matrix.rocm_indexes[0].rocm if matrix.rocm_indexes else None
    if inputs.os == "wsl":
        env, notes = env_rows(inputs, "rocm")
        if platform.dev_dxg is False:
            notes = notes.warn(
                "/dev/dxg is missing: WSL has no GPU paravirtualization, so ROCm cannot see the GPU.",
                "Install the current AMD Adrenalin driver on Windows, run `wsl --update`, then restart WSL.",
                check="wsl-bridge",
            )
        if not rocm_present(inputs):
            notes = notes.warn(
                "ROCm was not found inside WSL; ROCm on WSL needs ROCm and librocdxg.",
                f"Install ROCm {newest} for WSL: {matrix.urls['rocm_wsl']}",
                check="runtime",
            )
        return env, notes
    notes = NO_NOTES
    if not rocm_present(inputs):
        notes = notes.warn(
            "ROCm was not found. The PyTorch ROCm wheels bring their own ROCm libraries, but `rocminfo` "
            "and the amdgpu driver stack are needed to check the GPU.",
            f"Install ROCm {newest}: {matrix.urls['rocm_install']}",
        )
    if platform.dev_kfd is False:
        notes = notes.warn(
            "/dev/kfd is missing or not accessible: the amdgpu kernel driver is not loaded or you lack access.",
            "Install the amdgpu driver (amdgpu-install --usecase=rocm), "
            "then `sudo usermod -aG render,video $USER` and log in again.",
            check="dev-kfd",
        )
    return {}, notes


def user_env_advice(inputs: Inputs, vendor: str | None, env: dict[str, str], effective_arch: str | None) -> Notes:
    """An HSA override the user set makes ROCm load another GPU's kernels: say so, plan for the real GPU.

    ``env`` is what the plan sets; ``effective_arch`` the gfx target the ROCm runtime will load kernels for."""
    platform = inputs.platform
    value = platform.hsa_override or platform.env.get("HSA_OVERRIDE_GFX_VERSION")
    if inputs.os == "windows":
        if value:
            return NO_NOTES.warn(
                f"HSA_OVERRIDE_GFX_VERSION={value} is set but has no effect on Windows.",
                "Remove it from your user environment variables.",
            )
        return NO_NOTES
    if vendor != "amd":
        return NO_NOTES  # no AMD GPU to mislead
    if value is None:
        if platform.hsa_override_spoofs:  # detection saw the effect, not the variable
            spoofed = next((g for g in platform.gpus if g.reported_arch and g.reported_arch != g.arch), None)
            seen = f"reports {spoofed.reported_arch} for the real {spoofed.arch}" if spoofed else "reports another GPU"
            return NO_NOTES.warn(
                f"The ROCm runtime {seen}: an HSA_OVERRIDE_GFX_VERSION is set somewhere (a service, "
                "/etc/environment or a shell profile). The plan follows the real GPU.",
                "Find and remove it: "
                "grep -rs HSA_OVERRIDE_GFX_VERSION /etc/environment /etc/profile.d ~/.bashrc ~/.profile",
                check="hsa-override",
            )
        return NO_NOTES
    spoofs = platform.hsa_override_spoofs
    per_node = sorted(k for k in env if k.startswith("HSA_OVERRIDE_GFX_VERSION_"))
    if per_node:
        return NO_NOTES.warn(
            f"HSA_OVERRIDE_GFX_VERSION={value} changes every AMD GPU, but these GPUs are of different targets: "
            f"the plan sets {per_node[0]}={env[per_node[0]]} for the training GPU alone.",
            "unset HSA_OVERRIDE_GFX_VERSION, and remove it from ~/.bashrc or ~/.profile",
            check="hsa-override",
        )
    if value == env.get("HSA_OVERRIDE_GFX_VERSION"):
        return NO_NOTES  # exactly the override the plan sets
    if spoofs is False or (spoofs is None and gfx_of(value) == effective_arch):
        return NO_NOTES  # it names the GPU's own target: harmless
    return NO_NOTES.warn(
        f"HSA_OVERRIDE_GFX_VERSION={value} makes ROCm report {gfx_of(value) or 'another GPU'} instead of the real "
        f"{effective_arch or 'GPU'}, which loads the wrong kernels (crashes, wrong results). "
        "The plan follows the real GPU.",
        "unset HSA_OVERRIDE_GFX_VERSION, and remove it from ~/.bashrc or ~/.profile",
        check="hsa-override",
    )
