"""Write the golden plans (run once, from the code whose JSON they hold; rerun only for a deliberate
change of the JSON users see, and say so in the commit).

For each case: <case>.platform.json (the detected platform, the input) and <case>.plan.json (what
`unsloth install --dry-run --json` prints for it, byte for byte), planned from the matrix copy beside
them, so edits to the live matrix do not move these files. It writes the cases that have no files yet
(a new fixture dump); with --all it writes every case again from today's detection and planner.

    PYTHONPATH=src python tests/plan/golden/make_golden.py [--all]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from test_plan_golden import CASES, DUMPS, OVERRIDES, plan_text  # noqa: E402

from unsloth.platform.detect import detect_from_dump  # noqa: E402


def main(argv: list[str]) -> None:
    cases = [case for case in CASES if "--all" in argv or not (HERE / f"{case}.plan.json").is_file()]
    for case in cases:
        dump = case.split("@")[0]
        platform, _ = detect_from_dump(DUMPS / dump)
        (HERE / f"{case}.platform.json").write_text(json.dumps(platform.to_json(), indent=2) + "\n", encoding="utf-8")
        (HERE / f"{case}.plan.json").write_text(plan_text(platform.to_json(), OVERRIDES.get(case)), encoding="utf-8")
    print(f"wrote {len(cases)} cases to {HERE}")


if __name__ == "__main__":
    main(sys.argv[1:])
