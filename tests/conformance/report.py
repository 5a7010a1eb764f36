"""``python -m tests.conformance.report``: the conformance matrix of the last run.

One row per plan, one column per family; a cell is the largest relative error of that case
(the worse of its gradient and loss errors) when it passed, ``FAIL`` when it did not,
``refused`` when the plan was refused as it must be (the reasons are listed under the table),
and ``.`` when the case did not run (8-rank cases run in ``make test-full`` only). Reads the
JSON lines each case appended, one file per test tier (``conformance-<tier>.jsonl`` in
``WORKBENCH_CONFORMANCE_RESULTS``, default ``artifacts/tests``); exits 1 when a case failed, 2
when there is no file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .plans import OFFLOAD, PLANS

DEFAULT = "artifacts/tests"


def _cell(record: dict) -> str:
    if record["outcome"] == "pass":
        return f"{max(record['grad_rel'], record['loss_rel']):.0e}"
    return "FAIL" if record["outcome"] == "fail" else "refused"


def _short(plan: str) -> str:
    return plan.replace(OFFLOAD, "offload(all states)")


def render(records: list[dict]) -> str:
    families = list(dict.fromkeys(r["family"] for r in records))
    cells = {(r["family"], r["plan"]): r for r in records}
    plans = dict(PLANS)  # the matrix's plans first, then those only some files run (LoRA's)
    for r in records:
        plans.setdefault(r["plan"], r["ranks"])
    width = max(len(_short(p)) for p in plans) + 2
    widths = [max(10, len(f) + 2) for f in families]
    lines = [f"{'plan (ranks)':<{width + 4}}" + "".join(f"{f:>{w}}"
                                                        for f, w in zip(families, widths))]
    for plan, world in plans.items():
        row = [_cell(cells[f, plan]) if (f, plan) in cells else "." for f in families]
        lines.append(f"{_short(plan):<{width}}({world}) " + "".join(
            f"{c:>{w}}" for c, w in zip(row, widths)))
    counts = {o: sum(r["outcome"] == o for r in records) for o in ("pass", "refused", "fail")}
    lines.append(f"{len(records)} cases: {counts['pass']} equal the single process "
                 f"(gradient of every parameter and every step's loss within 1e-5), "
                 f"{counts['refused']} refused as they must be, {counts['fail']} failed")
    reasons = {}
    for r in records:
        if r["outcome"] == "refused":
            reasons.setdefault(r["message"], []).append(f"{r['family']} / {r['plan']}")
    for message, where in reasons.items():
        lines.append(f"refused ({'; '.join(where)}):\n    {message}")
    for r in records:
        if r["outcome"] == "fail":
            lines.append(f"FAILED {r['family']} / {r['plan']}: " + "; ".join(r["problems"][:3]))
    return "\n".join(lines)


def main() -> int:
    folder = Path(os.environ.get("WORKBENCH_CONFORMANCE_RESULTS", DEFAULT))
    files = sorted(folder.glob("conformance-*.jsonl"))
    if not files:
        print(f"no results in {folder}: run python -m pytest tests/conformance first",
              file=sys.stderr)
        return 2
    latest: dict[tuple[str, str], dict] = {}  # a case run again (another tier) counts once
    for f in sorted(files, key=lambda f: f.stat().st_mtime):
        for line in f.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                latest[record["family"], record["plan"]] = record
    records = list(latest.values())
    print(render(records))
    return 1 if any(r["outcome"] == "fail" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
