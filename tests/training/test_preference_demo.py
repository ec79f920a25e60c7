"""`unsloth train --demo dpo`: the tiny model comes to prefer the right capitals."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_dpo_demo_makes_the_chosen_answers_win(tmp_path, monkeypatch):
    from unsloth.training.demo import demos

    monkeypatch.setenv("UNSLOTH_KERNELS", "0")  # as on a CPU without the interpreter: the demo's own setting
    lines = []
    result = demos()["dpo"](output_dir=str(tmp_path / "demo"), max_steps=40, echo=lines.append)
    assert result.losses[-1] < result.losses[0]
    assert result.margin_after > result.margin_before + 1.0  # nats: the preferred answers pulled ahead
    assert result.won_after > result.won_before + 0.15  # 47% -> 75% at 40 steps; 98% at the default 60
    assert any("log p(chosen) - log p(rejected)" in line for line in lines)
    assert (tmp_path / "demo" / "lora" / "adapter_config.json").is_file()
