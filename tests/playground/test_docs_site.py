"""The documentation site (``make docs``) builds under ``mkdocs build --strict``; strict is real.

What is protected: the site built from mkdocs.yml has every notebook's page, rendered with the
outputs of its executed copy where the notebook tests left one in artifacts/notebooks/ (a line
that copy printed is on the page), else from the stored notebook (the build's log says so); the
home page is the README's text with its pictures; the API reference documents ``parallelize``;
and a link to a missing page or anchor, added to a copy of docs/, makes the same configuration
fail. ``make test-full``: each build takes 10 to 40 s on 2 busy cores (nbconvert on 11
notebooks, griffe on the packages). The hook that puts the README on the site has unit tests in
the fast tier: how its links are rewritten, and what a wrong include marker says.
"""

from __future__ import annotations

import html
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def build(config: Path, site: Path, artifacts: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site`` as ``make docs`` runs it, with the
    notebooks' executed copies from ``artifacts/notebooks/`` (docs/hooks/repo_pages.py)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "WORKBENCH_DOCS_ARTIFACTS": str(artifacts)}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], cwd=site.parent, env=env, capture_output=True, text=True,
                          timeout=600)


def printed_line(nb: nbformat.NotebookNode) -> str | None:
    """The first plain line of 10+ characters a code cell of ``nb`` printed, if any."""
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") != "stream":
                continue
            for line in output.get("text", "").splitlines():
                if len(line.strip()) >= 10 and "\x1b" not in line and "\r" not in line:
                    return line.strip()
    return None


def load_hook():
    """docs/hooks/repo_pages.py, which mkdocs loads by its path (it is not a package)."""
    spec = importlib.util.spec_from_file_location("repo_pages", ROOT / "docs/hooks/repo_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_included_links_point_where_the_site_publishes_their_targets():
    hook = load_hook()
    home = hook._included("README.md", None, "")  # docs/index.md's marker
    assert "](images/live-dashboard-in-notebook.png)" in home
    assert "](contributing.md#the-documentation-site-make-docs)" in home
    assert "](docs/" not in home and "](CONTRIBUTING.md" not in home
    # from a page one folder down, to a notebook, and what is left alone
    assert hook._relink("docs/images/a.png", "", "README.md", "api") == "../images/a.png"
    assert hook._relink("notebooks/00_quickstart.ipynb", "", "README.md", "api") == (
        "../notebooks/00_quickstart.ipynb")
    for target in ("https://example.org/x.md", "#magics", "/abs.md"):
        assert hook._relink(target, "", "README.md", "") == target
    quickstart = hook._included("README.md", "Quickstart", "")
    assert quickstart.startswith("## Quickstart") and "\n## Notebooks" not in quickstart


def test_a_wrong_include_marker_says_what_there_is():
    hook = load_hook()
    with pytest.raises(ValueError, match=r"has no '## Instal' section; its sections are: .*"
                                         r"Install, Quickstart"):
        hook._included("README.md", "Instal", "")
    with pytest.raises(FileNotFoundError, match="name a file by its path from the repository"):
        hook._included("READ_ME.md", None, "")


@pytest.mark.full
def test_site_builds_strict_with_the_notebooks_readme_and_api(tmp_path):
    snapshot = tmp_path / "artifacts" / "notebooks"  # the executed copies as they are now
    if (ROOT / "artifacts" / "notebooks").is_dir():
        shutil.copytree(ROOT / "artifacts" / "notebooks", snapshot)
    result = build(ROOT / "mkdocs.yml", tmp_path / "site", tmp_path / "artifacts")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    assert "execute=True" not in log  # mkdocs-jupyter renders, the notebook tests execute
    site = tmp_path / "site"

    executed = 0
    for stored in NOTEBOOKS:
        page = (site / "notebooks" / stored.stem / "index.html").read_text(encoding="utf-8")
        copy = snapshot / stored.name
        if not copy.is_file():
            assert stored.stem in log.split("stored without outputs")[1], log
            continue
        line = printed_line(nbformat.read(copy, as_version=4))
        if line is not None:
            assert html.escape(line) in page or html.escape(line, quote=False) in page, line
            executed += 1
    print(f"{executed} of {len(NOTEBOOKS)} notebook pages show an executed copy's output")

    home = (site / "index.html").read_text(encoding="utf-8")
    assert "A Jupyter-first workbench for training, fine-tuning and serving" in home
    assert 'src="images/live-dashboard-in-notebook.png"' in home
    assert (site / "images" / "live-dashboard-in-notebook.png").is_file()
    assert 'href="contributing/"' in home  # README's CONTRIBUTING.md link, rewritten
    api = (site / "api" / "kernels_runtime" / "index.html").read_text(encoding="utf-8")
    assert 'id="kernels_runtime.api.parallelize.parallelize"' in api


@pytest.mark.full
def test_a_broken_link_fails_the_strict_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("hooks"))
    with (docs / "architecture.md").open("a", encoding="utf-8") as f:
        f.write("\nSee [the design](no-such-page.md) and [the install](quickstart.md#no-such-"
                "anchor).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config["docs_dir"] = str(docs)  # the copy; everything else as make docs builds it
    config["hooks"] = [str(ROOT / p) for p in config["hooks"]]
    [plugin] = [p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p]
    handler = plugin["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(ROOT / p) for p in handler["paths"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")

    result = build(tmp_path / "mkdocs.yml", tmp_path / "site", tmp_path / "no-artifacts")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert "no-such-page.md" in log and "no-such-anchor" in log, log
    assert "Aborted with 2 warnings in strict mode" in log, log
