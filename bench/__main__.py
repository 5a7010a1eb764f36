"""``python -m bench NAME [options]`` or ``python -m bench all``."""

from __future__ import annotations

import importlib
import sys

from bench import BENCHMARKS, SUITES


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m bench {{{'|'.join(BENCHMARKS + SUITES)}|all}} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    names = BENCHMARKS if name == "all" else (name,)
    for n in names:
        if n not in BENCHMARKS + SUITES:
            print(f"unknown benchmark {n!r}; choose one of: "
                  f"{', '.join(BENCHMARKS + SUITES)}, all",
                  file=sys.stderr)
            return 2
        print(f"== bench {n}", flush=True)
        importlib.import_module(f"bench.{n}").main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
