"""mkdocs hook: publish pages whose source lives elsewhere in the repository.

Why: the README, CONTRIBUTING.md and the notebooks are read on GitHub and in JupyterLab first;
a copy of them under docs/ would drift. So the site reads them in place:

- A page of docs/ holding ``<!-- include README.md -->`` (or ``<!-- include README.md#Install
  -->``: one ``##`` section) gets that file's text, its relative links rewritten to where the
  site publishes their targets (``docs/images/x.png`` -> ``images/x.png``, ``CONTRIBUTING.md``
  -> ``contributing.md``). A link to a file the site does not publish is left as written, so
  strict validation fails on it, and a warning here says which file and how to fix it.
- Every ``notebooks/*.ipynb`` is added as ``notebooks/NAME.ipynb`` for mkdocs-jupyter to render,
  from ``artifacts/notebooks/NAME.ipynb`` (the executed copy the notebook tests write) when it
  exists, else from the stored notebook (no outputs); one log line says which came from where.
  mkdocs-jupyter never executes a notebook itself (``execute: false`` in mkdocs.yml).
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
# the executed copies are ARTIFACTS/notebooks/NAME.ipynb; $WORKBENCH_DOCS_ARTIFACTS names another
# ARTIFACTS (the docs test builds from a snapshot, so a notebook test finishing meanwhile cannot
# change its input)
ARTIFACTS_ENV = "WORKBENCH_DOCS_ARTIFACTS"
# repository files the site publishes under another path (docs/X is published as X)
PUBLISHED = {"README.md": "index.md", "CONTRIBUTING.md": "contributing.md"}

log = logging.getLogger("mkdocs.plugins.repo_pages")  # warnings here fail `mkdocs build --strict`
INCLUDE = re.compile(r"^<!-- include (?P<path>[^#\s]+)(?:#(?P<section>[^>]+?))? -->$", re.M)
LINK = re.compile(r"(?P<open>!?\[[^\]]*\]\()(?P<target>[^)\s]+)(?P<close>\))")


@event_priority(50)  # before mkdocs-jupyter's on_files wraps the .ipynb files it renders
def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every notebook, executed copy first (module docstring)."""
    artifacts = Path(os.environ.get(ARTIFACTS_ENV) or ROOT / "artifacts")
    folder = artifacts / "notebooks"
    executed, stored = [], []
    for stored_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        copy = folder / stored_path.name
        source = copy if copy.is_file() else stored_path
        (executed if source is copy else stored).append(stored_path.stem)
        # read from src_dir/src_uri (not File.generated(abs_src_path=...): mkdocs-jupyter's
        # wrapper of the file recomputes abs_src_path from src_dir, which that leaves None)
        src_dir = artifacts if source is copy else ROOT
        files.append(File(f"notebooks/{stored_path.name}", src_dir=str(src_dir),
                          dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls))
    log.info("notebooks: %d executed copies from %s (%s); %d stored without outputs (%s): "
             "`make test` writes the executed copies", len(executed), folder,
             ", ".join(executed) or "none", len(stored), ", ".join(stored) or "none")
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each include marker of ``page`` by the text it names."""
    page_dir = posixpath.dirname(page.file.src_uri)
    return INCLUDE.sub(lambda m: _included(m["path"], m["section"], page_dir), markdown)


def _included(path: str, section: str | None, page_dir: str) -> str:
    source = ROOT / path
    if not source.is_file():
        raise FileNotFoundError(f"<!-- include {path} -->: no file {source}; name a file by its "
                                "path from the repository root, e.g. README.md")
    text = source.read_text(encoding="utf-8")
    if section is not None:
        text = _section(text, section.strip(), path)
    source_dir = posixpath.dirname(path)
    return LINK.sub(lambda m: m["open"] + _relink(m["target"], source_dir, path, page_dir)
                    + m["close"], text)


def _section(text: str, title: str, path: str) -> str:
    """The ``## title`` section of ``text``, heading included, up to the next ``##``."""
    found = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if found is None:
        titles = re.findall(r"^## (.+)$", text, re.M)
        raise ValueError(f"<!-- include {path}#{title} -->: {path} has no '## {title}' section; "
                         f"its sections are: {', '.join(titles)}")
    return found.group(0)


def _relink(target: str, source_dir: str, source: str, page_dir: str) -> str:
    """``target`` as written in ``source``, made relative to the page including it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:|^[#/]", target):  # a URL, an anchor or an absolute path
        return target
    path, _, anchor = target.partition("#")
    in_repo = posixpath.normpath(posixpath.join(source_dir, path))
    if in_repo in PUBLISHED:
        published = PUBLISHED[in_repo]
    elif in_repo.startswith("docs/"):
        published = in_repo.removeprefix("docs/")
    elif re.fullmatch(r"notebooks/[^/]+\.ipynb", in_repo):
        published = in_repo
    else:
        log.warning("%s links to %s, which the documentation site does not publish: link a "
                    "page under docs/, a notebook or a full URL instead", source, in_repo)
        return target
    relative = posixpath.relpath(published, page_dir or ".")
    return relative + (f"#{anchor}" if anchor else "")
