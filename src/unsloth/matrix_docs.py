"""Render docs/hardware-support.md from the hardware matrix, so the doc cannot drift from the data.

    python -m unsloth.matrix_docs > docs/hardware-support.md

tests/plan/test_hardware_support_doc.py fails when the committed file differs from this output.
"""

from __future__ import annotations

import sys

from packaging.version import Version

from unsloth.matrix import Family, Matrix, default_path, load_matrix
from unsloth.plan import gfx_of

OS_TITLES = {"linux": "Linux", "wsl": "WSL2", "windows": "Windows", "macos": "macOS"}


def render(matrix: Matrix) -> str:
    sections = [
        _header(),
        _support_table(matrix),
        _reasons(matrix),
        _several_gpus(),
        _cuda_table(matrix),
        _rocm_table(matrix),
        _overrides(matrix),
        _bitsandbytes(matrix),
        _llama_cpp(matrix),
        _flash_linear_attention(matrix),
        _vllm(matrix),
        _env(matrix),
        _fits(matrix),
        _sources(matrix),
    ]
    return "\n\n".join(section.rstrip() for section in sections) + "\n"


def channel(matrix: Matrix, family: Family, os_name: str) -> str:
    """Where torch comes from for this cell, in a few words."""
    if matrix.cell(family.name, os_name).level == "unsupported":
        return "CPU"
    if family.vendor == "nvidia":
        low, high = _sm_range(family)
        return " / ".join(i.variant for i in matrix.cuda_indexes if i.covers(low) or i.covers(high)) + " (by driver)"
    if family.vendor == "amd":
        if os_name == "windows":
            leaves = sorted(set(family.amd_index.values()))
            return "AMD wheels " + ", ".join(f"`{leaf}`" for leaf in leaves)
        variants = [i.variant for i in matrix.rocm_indexes if i.archs & set(family.archs)]
        parts = [" / ".join(variants)] if variants else []
        if family.hsa_override:
            parts.append("override for " + _arch_list(family.hsa_override))
        unshipped = [
            a
            for a in family.amd_index
            if a not in family.hsa_override and not any(a in i.archs for i in matrix.rocm_indexes)
        ]
        if unshipped:
            parts.append("AMD wheels for " + _arch_list(unshipped))
        return "; ".join(parts)
    if family.name == "Apple":
        return "PyPI (MPS)"
    return "PyPI (CPU)" if os_name == "macos" else "cpu"


def _header() -> str:
    return (
        "# Hardware support\n\n"
        "<!-- Generated from src/unsloth/hardware_matrix.toml by `python -m unsloth.matrix_docs`; do not edit by hand. -->\n\n"
        "What `unsloth install` sets up for each GPU family on each OS, and how well it is supported.\n"
        "**full**: the tested path (QLoRA and our Triton kernels). **limited**: works, with the caveat given below.\n"
        "**unsupported**: the installer sets up CPU PyTorch and says why. `unsloth install --dry-run` shows the plan\n"
        "for your machine; [json.md](json.md) describes its JSON. Edit the matrix (or point `UNSLOTH_MATRIX` at your\n"
        "own copy), not this page."
    )


def _support_table(matrix: Matrix) -> str:
    head = "| Family | Vendor | Archs | Products | " + " | ".join(OS_TITLES.get(o, o) for o in matrix.oses) + " |"
    lines = [
        "## Support by family and OS",
        "",
        "Each cell: support level, then where PyTorch comes from.",
        "",
        head,
        "|" + "---|" * (4 + len(matrix.oses)),
    ]
    for family in matrix.families.values():
        cells = [f"**{matrix.cell(family.name, o).level}** · {channel(matrix, family, o)}" for o in matrix.oses]
        archs = _arch_list(family.archs) if family.archs else "—"
        lines.append(f"| {family.name} | {family.vendor} | {archs} | {family.products} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _reasons(matrix: Matrix) -> str:
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for (family, os_name), cell in matrix.support.items():
        grouped.setdefault((cell.level, cell.reason, cell.source), []).append(
            f"{family} × {OS_TITLES.get(os_name, os_name)}"
        )
    lines = ["## Why", ""]
    for (level, reason, source), cells in grouped.items():
        lines.append(f"- **{level}**, {reason}. _{', '.join(cells)}._ Source: {source}")
    return "\n".join(lines)


def _several_gpus() -> str:
    return (
        "## Several GPUs, pins and mirrors\n\n"
        "One GPU becomes the compute device (torch has one backend). The planner ranks GPUs by: support on this OS\n"
        "(full, then limited; unsupported last), discrete before integrated (a laptop's dGPU over its iGPU), NVIDIA\n"
        "before AMD before others, more VRAM, then the tool's order. `device_reason` in the plan says why.\n"
        "A same-vendor GPU that is not used and differs from the device (an iGPU, an unsupported card) is hidden with\n"
        "`HIP_VISIBLE_DEVICES` / `CUDA_VISIBLE_DEVICES` on Linux and WSL.\n\n"
        "`UNSLOTH_TORCH_INDEX_URL` pins the torch index verbatim (the plan warns if it names another backend);\n"
        "`UNSLOTH_PYTORCH_MIRROR` replaces `https://download.pytorch.org/whl` and `UNSLOTH_AMD_ROCM_MIRROR` replaces\n"
        "`https://repo.amd.com/rocm/whl`. An AMD GPU whose gfx target cannot be read gets a CPU plan and the fix."
    )


def _cuda_table(matrix: Matrix) -> str:
    lines = [
        "## NVIDIA: PyTorch CUDA indexes",
        "",
        "Of the indexes the driver runs and whose wheels cover the GPU's compute capability, a CUDA release the",
        "driver reports itself is preferred over one it runs only through minor-version compatibility; among those,",
        "the index whose torch range reaches the newest release, then the newest CUDA. Under WSL the Windows host",
        "driver counts.",
        "",
        "| Index | CUDA | Linux driver ≥ | Windows/WSL driver ≥ | Compute capability | torch | Source |",
        "|---|---|---|---|---|---|---|",
    ]
    for index in matrix.cuda_indexes:
        lines.append(
            f"| `{index.variant}` | {index.cuda} | {index.driver['linux']} | {index.driver['windows']} | "
            f"{index.sm[0]}–{index.sm[1]} | `{index.torch}` | {index.source} |"
        )
    return "\n".join(lines)


def _rocm_table(matrix: Matrix) -> str:
    lines = [
        "## AMD: PyTorch ROCm indexes (Linux and WSL)",
        "",
        "The newest index not newer than the host's ROCm that ships the GPU's gfx target (without ROCm found: the",
        "newest). On Windows, and for targets no index ships, AMD's own wheels come from",
        f"`{matrix.urls['amd']}/<family>/` (torch `{matrix.amd_torch}`).",
        "",
        "| Index | ROCm | gfx targets | torch | Source |",
        "|---|---|---|---|---|",
    ]
    for index in matrix.rocm_indexes:
        lines.append(
            f"| `{index.variant}` | {index.rocm} | {_arch_list(index.archs)} | `{index.torch}` | {index.source} |"
        )
    return "\n".join(lines)


def _overrides(matrix: Matrix) -> str:
    lines = [
        "## HSA_OVERRIDE_GFX_VERSION",
        "",
        "Set in the managed environment on Linux and WSL only (never on Windows), for targets no PyTorch index ships.",
        "An override the user set that makes ROCm report another GPU is flagged, and the plan follows the real GPU.",
        "When another AMD GPU of a different target sits beside the one trained on (an iGPU next to a dGPU), the",
        "plan sets the per-node form `HSA_OVERRIDE_GFX_VERSION_<n>` instead (n: the GPU's KFD node id, `kfd_node`",
        "in `detect --json`), so the other GPU keeps its own kernels.",
        "",
        "| gfx target | Override | Runs the kernels of | Source |",
        "|---|---|---|---|",
    ]
    for family in matrix.families.values():
        for arch, value in family.hsa_override.items():
            lines.append(f"| {arch} | `{value}` | {gfx_of(value)} | {family.source} |")
    return "\n".join(lines)


def _bitsandbytes(matrix: Matrix) -> str:
    lines = [
        "## bitsandbytes (QLoRA)",
        "",
        "No matching row: no QLoRA on that device (LoRA 16-bit still works).",
        "",
        "| Backend | OS | Package | Covers | Source |",
        "|---|---|---|---|---|",
    ]
    for row in matrix.bitsandbytes:
        covers = f"sm {row.sm[0]}–{row.sm[1]}" if row.sm else _arch_list(row.archs or ())
        lines.append(f"| {row.backend} | {', '.join(row.oses)} | `{row.spec}` | {covers} | {row.source} |")
    return "\n".join(lines)


def _llama_cpp(matrix: Matrix) -> str:
    lines = [
        "## llama.cpp (llama-cpp-python)",
        "",
        f"A prebuilt wheel from `{matrix.urls['llama_cpp_wheels']}/<tag>` when one covers the device,",
        "else a source build with `CMAKE_ARGS`. A GPU that cannot train (unsupported) still chats through Vulkan.",
        "",
        "| Backend | OS | Wheel tags | Wheel gfx targets | CMAKE_ARGS | Source |",
        "|---|---|---|---|---|---|",
    ]
    for row in matrix.llama_cpp:
        tags = ", ".join(f"{key} → `{tag}`" for key, tag in row.wheel.items())
        archs = _arch_list(row.wheel_archs) if row.wheel_archs else "—"
        lines.append(
            f"| {row.backend} | {', '.join(row.oses)} | {tags} | {archs} "
            f"| `{row.cmake_args or '(none)'}` | {row.source} |"
        )
    return "\n".join(lines)


def _flash_linear_attention(matrix: Matrix) -> str:
    lines = [
        "## flash-linear-attention (Qwen3.5's Gated DeltaNet layers)",
        "",
        "Its Triton kernels, from the package sources, installed after everything else with everything installed",
        "pinned; a failed install is not fatal (the receipt's `optional_failed`, a doctor warning), and",
        "`--without fla` leaves it out. No matching row (CPU, Apple MPS, native Windows, whose PyTorch wheels bring",
        "no Triton): our torch chunked rule runs those layers. On the GPUs of a row's broken compute",
        "capabilities it is left out when the Triton the plan's torch pins (below) is in the broken range,",
        "with the reason and the fix in the plan. causal-conv1d is never installed: PyPI has only its source",
        "(an nvcc build), and transformers' torch path runs the short convolution.",
        "",
        "| Backend | OS | Package | Left out on | Source |",
        "|---|---|---|---|---|",
    ]
    for row in matrix.flash_linear_attention:
        broken = (f"compute capability {row.broken_sm[0]}–{row.broken_sm[1]} with Triton `{row.broken_triton}`"
                  if row.broken_sm else "—")
        lines.append(f"| {row.backend} | {', '.join(row.oses)} | `{row.spec}` | {broken} | {row.source} |")
    if not matrix.flash_linear_attention:
        lines.append("| — | — | none: not installed anywhere | — | — |")
    if matrix.torch_triton:
        releases = sorted(matrix.torch_triton)
        lines += [
            "",
            "The Triton each torch release pins (CUDA builds): the plan reads that of the newest release its torch",
            "specifier admits. " + ", ".join(f"torch {torch} → {matrix.torch_triton[torch]}" for torch in releases) + ".",
        ]
    return "\n".join(lines)


def _vllm(matrix: Matrix) -> str:
    lines = [
        "## vLLM (`--with vllm`)",
        "",
        "Opt-in: only `unsloth install --with vllm` installs it, from the package sources, for GRPO rollouts",
        "through TRL's colocated vLLM engine when a model is loaded with `fast_inference=True`. Its wheel is",
        "built against one exact torch, so that plan installs that torch from that index instead of the newest.",
        "No matching row (native Windows, macOS, ROCm, Intel, CPU-only, another CPU, a GPU or driver the CUDA",
        "build does not cover): `--with vllm` is refused before anything is installed, with the reason;",
        "GRPO and `fast_inference=True` then run on unsloth's own fast generation path.",
        "",
        "| Backend | OS | CPUs | Package | torch (index) | Also pinned | Python | Source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in matrix.vllm:
        pinned = ", ".join(f"`{text}`" for text in row.torch_packages) or "—"
        lines.append(f"| {row.backend} | {', '.join(row.oses)} | {', '.join(row.machines)} | `{row.spec}` "
                     f"| `torch{row.torch}` ({row.variant}) | {pinned} | {row.python} | {row.source} |")
    if not matrix.vllm:
        lines.append("| — | — | — | none: refused everywhere | — | — | — | — |")
    return "\n".join(lines)


def _env(matrix: Matrix) -> str:
    lines = ["## Environment variables", "", "| torch backend | OS | Variables | Source |", "|---|---|---|---|"]
    for row in matrix.env:
        variables = ", ".join(f"`{key}={value}`" for key, value in row.vars.items())
        lines.append(f"| {row.backend} | {', '.join(row.oses)} | {variables} | {row.source} |")
    lines += [
        "",
        "Also: `HSA_OVERRIDE_GFX_VERSION` (above); `HIP_VISIBLE_DEVICES` or `CUDA_VISIBLE_DEVICES` (with",
        "`CUDA_DEVICE_ORDER=PCI_BUS_ID`) when a same-vendor GPU that is not the compute device must be hidden.",
    ]
    return "\n".join(lines)


def _fits(matrix: Matrix) -> str:
    rule = matrix.fits
    lines = [
        "## Which models fit",
        "",
        f"Memory needed ≈ parameters × bytes per parameter × (1 + {rule.overhead}) + {rule.fixed_gib} GiB, with",
        f"{rule.qlora_bytes_per_param} bytes per parameter for QLoRA (4-bit NF4 and its scales)",
        f"and {rule.lora16_bytes_per_param} for LoRA 16-bit. The overhead stands for LoRA weights, optimizer state",
        "and activations at a short context; the constant for the runtime context. A rule of thumb, not a promise.",
        f"Source: {rule.source}.",
        "",
        "| Parameters | QLoRA (GiB) | LoRA 16-bit (GiB) |",
        "|---|---|---|",
    ]
    for size in rule.model_sizes_b:
        qlora = size * 1e9 * rule.qlora_bytes_per_param * (1 + rule.overhead) / 2**30 + rule.fixed_gib
        lora16 = size * 1e9 * rule.lora16_bytes_per_param * (1 + rule.overhead) / 2**30 + rule.fixed_gib
        lines.append(f"| {size:g}B | {qlora:.1f} | {lora16:.1f} |")
    return "\n".join(lines)


def _sources(matrix: Matrix) -> str:
    lines = ["## Sources", "", "- Families: " + "; ".join(f"{f.name}: {f.source}" for f in matrix.families.values())]
    lines += [f"- {name}: {source}" for name, source in matrix.sources.items()]
    return "\n".join(lines)


def _sm_range(family: Family) -> tuple[Version, Version]:
    versions = sorted(Version(f"{arch[3:-1]}.{arch[-1]}") for arch in family.archs)
    return versions[0], versions[-1]


def _arch_list(archs) -> str:
    return ", ".join(sorted(archs, key=lambda arch: (len(arch), arch)))


def main() -> int:
    sys.stdout.write(render(load_matrix(sys.argv[1] if len(sys.argv) > 1 else default_path())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
