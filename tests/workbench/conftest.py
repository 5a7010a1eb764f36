"""HF ``generate``'s greedy answers of the real pretrained model (SmolLM2-135M-Instruct, the
session's ``smollm2`` of ``tests/conftest.py``) to the six chat prompts, computed once per
session (all 30 layers: ~7 s on 2 idle cores) and compared against every engine plan and the
server."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from helpers import real_model


@dataclass(frozen=True)
class Greedy:
    """The chat prompts (token ids, the model's template applied) and HF ``generate``'s greedy
    new tokens for each, ``real_model.NEW`` at most, the end-of-turn token kept where it
    stopped."""

    prompts: list[list[int]]
    tokens: list[list[int]]


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2) -> Greedy:
    prompts = real_model.chat_ids(smollm2.folder, real_model.CHAT)
    tokens = real_model.hf_greedy(smollm2.folder, prompts)
    # both ways of stopping are on trial: the end-of-turn token, and the token budget
    assert any(len(t) < real_model.NEW for t in tokens), tokens
    assert any(len(t) == real_model.NEW for t in tokens), tokens
    return Greedy(prompts, tokens)


@pytest.fixture
def slurm(tmp_path_factory):
    """A one-node Slurm cluster on this host (real munged, slurmctld, slurmd; root only), for
    tests that start pools with ``--launcher slurm``; clients find it through ``slurm.env()``.
    ``test_slurm.py`` keeps a module-wide one of its own."""
    import socket

    from helpers.prereq import require
    from helpers.slurm_cluster import SlurmCluster, SlurmNode

    require(["slurmctld", "slurmd", "munged", "sbatch"], root=True, why="Slurm launcher")
    node = SlurmNode(socket.gethostname(), "127.0.0.1", cpus=4)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), node, [node]).start()
    yield cluster
    cluster.stop()
