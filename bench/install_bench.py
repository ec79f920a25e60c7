"""Benchmark (not a test): time to a ready environment, and re-run time, uv against pip.

Same plan (this machine's), same source (this checkout), same options, and the same cache state for
both tools: "cold" starts from empty uv/pip caches (every wheel is downloaded from the configured
indexes), "warm" from caches that already hold them. Each install starts from an empty install home.
"Ready" includes verification (imports, doctor's environment checks), which costs the same for both
tools; the install steps alone are reported beside it.

    python bench/install_bench.py [--states cold warm] [--tools uv pip]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"✓ (.+?) \((\d+\.\d+)s\)")
INSTALL_STEPS = ("Python environment", "PyTorch", "unsloth, transformers", "GGUF export tools")


def frozen_source(dest: Path) -> Path:
    """A copy of this checkout's files (tracked and untracked, not ignored), so edits during the run do not count."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True)
    for rel in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def run_install(home: Path, caches: Path, tool: str, source: Path) -> tuple[float, float, str]:
    """(wall seconds, seconds in install steps, output) of one `unsloth install`."""
    env = {**os.environ, "UNSLOTH_HOME": str(home / "unsloth"), "HOME": str(home), "UV_CACHE_DIR": str(caches / "uv"),
           "PIP_CACHE_DIR": str(caches / "pip"), "NO_COLOR": "1", "COLUMNS": "200"}
    argv = [sys.executable, "-m", "unsloth.cli", "install", "--yes", "--without", "llama-cpp", "--no-modify-path",
            "--source", str(source)] + (["--pip"] if tool == "pip" else [])
    start = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{tool} install failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    steps = sum(float(s) for title, s in STEP.findall(done.stdout) if title.startswith(INSTALL_STEPS))
    return wall, steps, done.stdout


def measure(tool: str, state: str, warm_caches: Path, source: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{tool}-{state}-") as tmp:
        tmp = Path(tmp)
        caches = warm_caches if state == "warm" else tmp / "caches"
        ready, steps, _ = run_install(tmp / "home", caches, tool, source)
        rerun, _, out = run_install(tmp / "home", caches, tool, source)
        assert "Up to date" in out, out[-2000:]
        return {"tool": tool, "state": state, "ready_s": ready, "install_steps_s": steps, "rerun_s": rerun}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", nargs="+", default=["uv", "pip"])
    parser.add_argument("--states", nargs="+", default=["cold", "warm"])
    args = parser.parse_args()
    warm = Path(tempfile.mkdtemp(prefix="bench-warm-caches-"))
    source = frozen_source(Path(tempfile.mkdtemp(prefix="bench-source-")))
    try:
        for tool in args.tools:  # fill the shared warm caches once per tool, untimed
            if "warm" in args.states:
                with tempfile.TemporaryDirectory() as tmp:
                    run_install(Path(tmp), warm, tool, source)
        rows = [measure(tool, state, warm, source) for state in args.states for tool in args.tools]
    finally:
        shutil.rmtree(warm, ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)
    print("| installer | caches | time to a ready environment | of which install steps | re-run (nothing to do) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tool']} | {row['state']} | {row['ready_s']:.0f} s | {row['install_steps_s']:.0f} s | {row['rerun_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
