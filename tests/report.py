"""Where the test time went: ``python -m tests.report`` reads the JUnit XML each tier wrote under
``artifacts/tests/`` (``make test-fast``, ``make test``, ``make test-full``, ``make
test-install``) and prints, per tier, its count and time, the slowest tests and the time per
package, so the budgets are kept by looking, not by asserting times."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "tests"
TIERS = ("fast", "test", "full", "bench", "browser", "daemons", "install", "hub", "image")


@dataclass(frozen=True)
class Case:
    nodeid: str
    seconds: float
    outcome: str  # passed, failed, error, skipped

    @property
    def package(self) -> str:
        """``tests/runtime/parallel`` for a case in ``tests/runtime/parallel/test_x.py``."""
        return self.nodeid.split("::")[0].rsplit("/", 1)[0]


def read_cases(path: Path) -> list[Case]:
    """The test cases of one JUnit XML file, as pytest writes it (classname ``a.b.test_x``)."""
    cases = []
    for node in ET.parse(path).getroot().iter("testcase"):
        module = node.get("classname", "").replace(".", "/")
        outcome = "passed"
        for child in node:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        cases.append(Case(f"{module}.py::{node.get('name')}", float(node.get("time", 0)),
                          outcome))
    return cases


def describe(tier: str, cases: list[Case], slowest: int) -> str:
    total = sum(c.seconds for c in cases)
    outcomes = defaultdict(int)
    for case in cases:
        outcomes[case.outcome] += 1
    counts = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    lines = [f"== {tier}: {len(cases)} cases ({counts}), {total:.0f} s in tests "
             f"({total / 60:.1f} min)"]
    lines.append(f"   the {min(slowest, len(cases))} slowest:")
    for case in sorted(cases, key=lambda c: -c.seconds)[:slowest]:
        lines.append(f"   {case.seconds:8.1f} s  {case.nodeid}")
    per_package: dict[str, float] = defaultdict(float)
    for case in cases:
        per_package[case.package] += case.seconds
    lines.append("   per package:")
    for package, seconds in sorted(per_package.items(), key=lambda kv: -kv[1]):
        lines.append(f"   {seconds:8.1f} s  {package}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowest", type=int, default=30, help="how many slowest tests")
    parser.add_argument("--dir", type=Path, default=ARTIFACTS, help="where the XML files are")
    parser.add_argument("--tier", choices=TIERS, action="append",
                        help="only this tier (repeatable; all that ran by default)")
    args = parser.parse_args(argv)
    found = [(tier, args.dir / f"{tier}.xml") for tier in args.tier or TIERS
             if (args.dir / f"{tier}.xml").exists()]
    if not found:
        print(f"no test results under {args.dir}: run make test-fast, test, test-full or "
              "test-install first", file=sys.stderr)
        return 2
    every = []
    for tier, path in found:
        cases = read_cases(path)
        every.extend(cases)
        print(describe(tier, cases, args.slowest))
    if len(found) > 1:
        print(f"== all tiers: {len(every)} cases, {sum(c.seconds for c in every) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
