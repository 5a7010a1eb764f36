"""Execute a notebook headless with nbclient, echoing each cell's text output as it finishes.

Used by ``workbench demo``/``workbench run`` and by the tests, so the notebooks users open are
the notebooks CI executes. Widget state is not stored (it would add megabytes per notebook).

Parameters work as papermill's do, so a notebook becomes an unattended job: the cell tagged
``parameters`` holds the defaults, and ``workbench run NB -p STEPS=1000`` runs a copy with a cell
assigning the new values inserted right after it (tagged ``injected-parameters``).

``start_options`` (``workbench run --launcher slurm -n 4 ...``) reach the kernel's
``%colossal start`` through ``$WORKBENCH_START_OPTIONS`` (``workbench.pool.start_options``), so one
notebook runs on any launcher unedited. With ``save_to``, the last ``%%colossal`` cell's
dashboard is written beside the executed notebook as a standalone report (``NAME.report.html``,
``Dashboard.to_html``) by one more cell, run in the same kernel after the notebook's last and
kept out of the saved notebook.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import nbformat
from nbclient import NotebookClient

from workbench.pool.start_options import ENV as START_OPTIONS_ENV

# run after the notebook's cells in its kernel: the dashboard of the last %%colossal cell
REPORT_CELL = """import workbench as _workbench
try:
    print("dashboard report:", _workbench.show_dashboard().to_html({path!r}))
except ValueError as _e:  # no %%colossal cell ran: nothing to report
    print("no dashboard report:", _e)
"""


def _output_text(output: dict[str, Any]) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return output.get("text", "")
    if kind in ("execute_result", "display_data"):
        text = output.get("data", {}).get("text/plain", "")
        return text + ("\n" if text and not text.endswith("\n") else "")
    if kind == "error":
        return "\n".join(output.get("traceback", [])) + "\n"
    return ""


class ParameterError(ValueError):
    """A ``-p`` the notebook cannot take (raised before any cell runs)."""


def parse_parameter(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` from the command line: a Python literal (``20``, ``3e-4``, ``"x"``,
    ``[1, 2]``), else the text itself as a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise ParameterError(f"-p {text!r}: write NAME=VALUE, e.g. -p STEPS=20")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return name.strip(), value


def inject_parameters(nb: nbformat.NotebookNode, parameters: dict[str, Any]) -> None:
    """Insert a cell assigning ``parameters`` after the cell tagged ``parameters``; each name
    must be one that cell assigns (a typo would otherwise be silently ignored)."""
    tagged = [i for i, c in enumerate(nb.cells)
              if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not tagged:
        raise ParameterError("this notebook has no cell tagged 'parameters': tag the cell holding "
                         "its defaults (JupyterLab: the property inspector, Add Tag)")
    cell = nb.cells[tagged[0]]
    known = {t.id for node in ast.walk(ast.parse(cell.source))
             if isinstance(node, ast.Assign) for t in _targets(node)}
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ParameterError(f"-p {', '.join(unknown)}: not a parameter of this notebook; its "
                         f"parameters cell assigns {', '.join(sorted(known))}")
    source = "# injected by workbench run -p\n" + "".join(
        f"{name} = {value!r}\n" for name, value in parameters.items())
    injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, injected)


def _targets(node: ast.Assign) -> list[ast.Name]:
    names = []
    for target in node.targets:
        elements = target.elts if isinstance(target, ast.Tuple) else [target]
        names += [e for e in elements if isinstance(e, ast.Name)]
    return names


def run_notebook(
    path: str | os.PathLike[str],
    *,
    timeout_s: int = 600,
    echo: TextIO | None = sys.stdout,
    save_to: str | os.PathLike[str] | None = None,
    kernel_name: str = "python3",
    workdir: str | os.PathLike[str] | None = None,
    parameters: dict[str, Any] | None = None,
    start_options: str = "",
) -> nbformat.NotebookNode:
    """Run every cell of ``path`` in a fresh kernel (started in ``workdir``, default: the
    notebook's folder) with ``parameters`` injected and ``start_options`` given to its
    ``%colossal start`` (module docstring); raise on the first error. With ``save_to``, write
    the executed notebook there and the dashboard report beside it."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    if parameters:
        inject_parameters(nb, parameters)
    report = report_path(save_to).resolve() if save_to is not None else None
    if report is not None:
        nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL.format(path=str(report))))
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name=kernel_name,
        store_widget_state=False,
        resources={"metadata": {"path": str(Path(workdir or path.parent).resolve())}},
    )
    if echo is not None:
        def on_cell_executed(cell: Any, cell_index: int, **_: Any) -> None:
            for output in cell.get("outputs", []):
                echo.write(_output_text(output))
            echo.flush()

        client.on_cell_executed = on_cell_executed
    env = {k: v for k, v in os.environ.items() if k != START_OPTIONS_ENV}
    if start_options:  # this run's, never inherited ones
        env[START_OPTIONS_ENV] = start_options
    try:
        client.execute(env=env)
    finally:
        if report is not None:
            nb.cells.pop()  # the report cell is the runner's, not the notebook's
    if save_to is not None:
        nbformat.write(nb, save_to)
    return nb


def report_path(save_to: str | os.PathLike[str]) -> Path:
    """Where the dashboard report of a notebook saved at ``save_to`` goes: beside it,
    ``run.ipynb`` -> ``run.report.html``."""
    save_to = Path(save_to)
    return save_to.with_name(save_to.stem + ".report.html")
