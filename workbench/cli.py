"""The ``workbench`` command: run the demo, execute notebooks headless, show the version."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench import __version__

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_NOTEBOOKS = [REPO_ROOT / "notebooks" / name
                  for name in ("00_quickstart.ipynb", "01_pretrain_gpt.ipynb")]


def _cmd_run(args: argparse.Namespace) -> int:
    from workbench.notebook_runner import run_notebook

    for path in args.notebooks:
        print(f"== running {path}", flush=True)
        run_notebook(path, timeout_s=args.timeout, save_to=args.save)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    missing = [str(p) for p in DEMO_NOTEBOOKS if not p.exists()]
    if missing:
        print(f"demo notebooks not found: {', '.join(missing)}; run from a source checkout",
              file=sys.stderr)
        return 2
    args.notebooks, args.save = DEMO_NOTEBOOKS, None
    return _cmd_run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"colossal-workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run the quickstart and GPT-2 pretraining notebooks on a 2-rank pool")
    demo.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    demo.set_defaults(func=_cmd_demo)
    run = sub.add_parser("run", help="execute notebooks headless, printing their output")
    run.add_argument("notebooks", nargs="+", type=Path)
    run.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    run.add_argument("--save", type=Path, default=None, help="write the executed notebook here")
    run.set_defaults(func=_cmd_run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
