"""The runtime without the notebook: ``examples/train_gpt2.py`` under a real ``torchrun``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_runtime.comm import find_free_port

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"


def _torchrun(*args: str, cwd: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(find_free_port()), str(EXAMPLE), "--json", *args]
    env = dict(os.environ, WORKBENCH_CACHE_DIR=str(cwd / "cache"), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tokens/s over 2 ranks" in out.stdout and "rank 1: peak host memory" in out.stdout
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchrun_trains_saves_and_resumes(tmp_path):
    plan = ["--plan", "zero=2 bf16"]
    full = _torchrun(*plan, "--steps", "40", cwd=tmp_path)
    assert full["losses"][-1] < 0.8 * full["losses"][0]
    _torchrun(*plan, "--steps", "20", "--save", "ckpt", cwd=tmp_path)
    resumed = _torchrun(*plan, "--steps", "40", "--resume", "ckpt", cwd=tmp_path)
    assert resumed["start"] == 20
    assert resumed["losses"] == full["losses"][20:]  # exact continuation
