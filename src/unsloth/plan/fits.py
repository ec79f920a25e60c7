"""Step 4: which model sizes fit in the device's memory: the documented formula in hardware_matrix.toml [fits]."""

from __future__ import annotations

from unsloth.matrix import Matrix
from unsloth.plan.model import FitRow, Fits
from unsloth.platform.facts import Gpu

GIB = 2**30


def fits(matrix: Matrix, device: Gpu | None, ram_bytes: int | None, qlora: bool) -> Fits:
    """The VRAM of ``device``, else the RAM when training runs on the host."""
    rule = matrix.fits
    memory, kind = (device.vram_bytes, "vram") if device else (ram_bytes, "ram")
    if not memory:
        return Fits(kind)

    def need_gib(params_b: float, bytes_per_param: float) -> float:
        return round(params_b * 1e9 * bytes_per_param * (1 + rule.overhead) / GIB + rule.fixed_gib, 1)

    gib = memory / GIB
    table = [FitRow(size, need_gib(size, rule.qlora_bytes_per_param), need_gib(size, rule.lora16_bytes_per_param))
             for size in rule.model_sizes_b]
    return Fits(
        memory=kind,
        memory_gib=round(gib, 1),
        qlora_max_b=max((r.params_b for r in table if r.qlora_gib <= gib), default=None) if qlora else None,
        lora16_max_b=max((r.params_b for r in table if r.lora16_gib <= gib), default=None),
        table=table,
    )
