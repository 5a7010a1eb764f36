"""The notebooks' copy into each home at server start (deploy/jupyterhub/start_singleuser.py).

What is protected: missing files arrive (subfolders included), a notebook the user changed is
kept as the user left it, and Jupyter's checkpoint folders are not copied.
"""

from __future__ import annotations

from pathlib import Path

from start_singleuser import copy_missing


def test_copies_what_is_missing_and_keeps_the_users_edits(tmp_path: Path):
    src, home = tmp_path / "src", tmp_path / "home" / "notebooks"
    (src / "reports").mkdir(parents=True)
    (src / ".ipynb_checkpoints").mkdir()
    (src / "00_quickstart.ipynb").write_text("new quickstart")
    (src / "01_pretrain_gpt.ipynb").write_text("pretrain")
    (src / "reports" / "a.md").write_text("report")
    (src / ".ipynb_checkpoints" / "x.ipynb").write_text("checkpoint")
    home.mkdir(parents=True)
    (home / "00_quickstart.ipynb").write_text("the user's edits")

    assert copy_missing(src, home) == 2
    assert (home / "00_quickstart.ipynb").read_text() == "the user's edits"
    assert (home / "01_pretrain_gpt.ipynb").read_text() == "pretrain"
    assert (home / "reports" / "a.md").read_text() == "report"
    assert not (home / ".ipynb_checkpoints").exists()
    assert copy_missing(src, home) == 0  # the next start copies nothing again
