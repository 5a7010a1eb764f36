"""The conformance matrix's session state: the real SmolLM2 cut to two blocks (from the session's
converted checkpoint), the references computed once per (family, batch split), and a fresh
results file for the report."""

from __future__ import annotations

import pytest

from conformance import families, harness


@pytest.fixture(scope="session", autouse=True)
def fresh_results() -> None:
    """This session's cells only: the report reads what the last run measured."""
    harness.RESULTS.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm2_cut(smollm2, tmp_path_factory):
    folder = families.cut_smollm2(smollm2.folder, tmp_path_factory.mktemp("smollm2-2-blocks"))
    families.smollm2_folder(folder)
    return folder


@pytest.fixture(scope="session")
def references() -> dict:
    return {}
