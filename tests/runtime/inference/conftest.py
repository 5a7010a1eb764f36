"""The trained models every inference test shares (trained once per session)."""

from __future__ import annotations

import pytest

from helpers import inference as inf


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("trained")
    return {kind: str(inf.train(kind, folder)) for kind in ("gpt2", "llama")}
