"""Checkpoint hygiene: a failed save leaves nothing behind, and metadata cannot point outside.

What is protected: when a save fails without a crash (a rank's write raises, or rank 0's
commit does), every rank raises, and by the time any rank has raised its ``.tmp-step-*`` folder
is gone, with the previous checkpoint and ``latest`` untouched and the next save working. And
``meta.json`` is data, not a list of paths: a data file name other than the writer's
``rank-NNNNN.safetensors`` (``../x``, an absolute path, another pattern) is refused with an
error naming the file, before any file is opened.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.distributed import context

FAILURES = ("write-error@1", "write-error@0", "commit-error@0")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _failed_saves(rank: int, world: int, directory: Path) -> dict:
    """Save step 1, then step 2 failing at each of FAILURES, then step 2 for real."""
    from kernels_runtime import load, parallelize
    from kernels_runtime.checkpoint import save
    from kernels_runtime.checkpoint.saver import CRASH_ENV

    ctx = context("dp=2 zero=2")
    model = _mlp()
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=0.01), ctx=ctx)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    opt.backward(model(x).square().mean())
    opt.step()
    save(directory, model, opt, 1)
    out: dict = {}
    for spec in FAILURES:
        os.environ[CRASH_ENV] = spec
        try:
            save(directory, model, opt, 2)
            out[spec] = ("no error", "", [])
        except Exception as err:  # what this rank sees the moment save gives up
            out[spec] = (type(err).__name__, str(err), sorted(os.listdir(directory)))
        finally:
            del os.environ[CRASH_ENV]
    save(directory, model, opt, 2)
    out["after"] = sorted(os.listdir(directory))
    out["reload"] = load(directory, model, opt)["step"]
    return out


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> tuple[Path, list[dict]]:
    directory = tmp_path_factory.mktemp("hygiene") / "ckpt"
    return directory, ranks(2).run(_failed_saves, directory)


@pytest.mark.parametrize("spec", FAILURES)
def test_a_failed_save_removes_its_temporary_folder(saved, spec) -> None:
    _, per_rank = saved
    failing = int(spec.partition("@")[2])
    for rank, out in enumerate(per_rank):
        kind, message, entries = out[spec]
        assert kind == "CheckpointError", (rank, kind, message)
        if rank == failing:
            assert "failure injected" in message, message
        else:
            assert f"failed on rank {failing}" in message, message
        assert entries == ["latest", "step-00000001"], (rank, entries)
    for out in per_rank:
        assert out["after"] == ["latest", "step-00000001", "step-00000002"], out["after"]
        assert out["reload"] == 2


def _read_with_files(step_dir: Path, tmp: Path, rename: str) -> str:
    """Copy ``step_dir``, list its rank-0 file as ``rename`` in meta.json, open a reader."""
    from kernels_runtime.checkpoint import format as fmt
    from kernels_runtime.checkpoint.reader import CheckpointReader

    copy = tmp / "copy" / step_dir.name
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(step_dir, copy)
    (copy.parent / "x").write_bytes(b"not a checkpoint file")
    meta = json.loads((copy / fmt.META).read_text())
    meta["files"][rename] = meta["files"].pop(fmt.rank_file_name(0))
    (copy / fmt.META).write_text(json.dumps(meta))
    try:
        with CheckpointReader(copy, fmt.read_meta(copy)) as reader:
            reader.full("0.weight")
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "rank-0.safetensors",
                                  "model.safetensors", "sub/rank-00000.safetensors",
                                  "rank-00000.safetensors/../../x"])
def test_metadata_naming_other_files_is_refused(saved, tmp_path, name) -> None:
    directory, _ = saved
    got = _read_with_files(directory / "step-00000002", tmp_path, name)
    assert got.startswith("CheckpointError"), got
    assert name in got and "rank-NNNNN.safetensors" in got and "never makes" in got, got


def test_metadata_with_the_writers_names_reads(saved, tmp_path) -> None:
    directory, _ = saved
    assert _read_with_files(directory / "step-00000002", tmp_path,
                            "rank-00000.safetensors") == "no error"
