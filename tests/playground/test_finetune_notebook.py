"""Notebook 10 fine-tunes the real SmolLM2 with LoRA on a pool, exports and serves the adapter.

What is protected: at the tests' size (``WORKBENCH_QUICK=1``, 2 ranks under dp=2) the notebook
runs top to bottom under nbclient; the held-out loss it prints after training is below the one
before (the adapter learned answers for functions it never saw); the side-by-side cell shows the
base and the fine-tuned answers to three held-out questions; the exported folder is peft's
(config and safetensors, no base weights); the endpoint lists the adapter beside the base model
and answers the openai client naming it. The run time is printed, never asserted (the issue's
target: 90 s on 2 CPU cores). ``make test-full``: a kernel, a 2-rank pool and the real model for
over a minute; the demo's own fine-tune (``workbench.demo``) is checked here too, in one process.
"""

from __future__ import annotations

import ast
import io
import re
import time
from pathlib import Path

import pytest

from helpers.notebooks import run_notebook  # also keeps the executed copy for the docs

pytest.importorskip("peft")
pytest.importorskip("openai")
pytest.importorskip("datasets")
pytestmark = [pytest.mark.engines, pytest.mark.full]
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "10_finetune.ipynb"


@pytest.mark.timeout(600)  # 2 minutes measured with other tests sharing the 2 cores
def test_finetune_notebook_lowers_the_held_out_loss_exports_and_serves_the_adapter(
        tmp_path, monkeypatch, smollm2):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(smollm2.folder.parent.parent))
    monkeypatch.setenv("WORKBENCH_RANKS", "2")
    monkeypatch.setenv("WORKBENCH_QUICK", "1")
    echo = io.StringIO()
    start = time.perf_counter()
    nb = run_notebook(NOTEBOOK, timeout_s=300, echo=echo, workdir=tmp_path)
    seconds = time.perf_counter() - start
    print(f"notebook 10 at the tests' size: {seconds:.1f} s")
    text = echo.getvalue()
    assert "2 ranks (WORKBENCH_RANKS=2): LoRA trains under dp=2" in text
    before, after = (float(x) for x in re.search(
        r"^held-out loss: before (\S+) -> after (\S+) ", text, re.M).groups())
    assert after < before, (before, after)
    first = float(re.search(r"^held-out loss before fine-tuning: (\S+) ", text, re.M).group(1))
    assert first == before  # the same evaluation, printed twice
    tuned = [ast.literal_eval(t) for t in re.findall(r"^  fine-tuned: (.+)$", text, re.M)]
    base = [ast.literal_eval(t) for t in re.findall(r"^  base: +(.+)$", text, re.M)]
    assert len(tuned) == len(base) == 3 and all(tuned) and all(base), text
    names = {p.name for p in (tmp_path / "adapters" / "stdlib-qa").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names
    assert not any(n.startswith("model") for n in names), names  # the adapter alone
    assert "models: ['engine', 'stdlib-qa']" in text
    replies = {name: ast.literal_eval(reply) for name, reply in re.findall(
        r"^(engine|stdlib-qa): What does \S+ do\? (.+)$", text, re.M)}
    assert set(replies) == {"engine", "stdlib-qa"} and all(replies.values()), text
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors


@pytest.mark.timeout(600)
def test_the_demo_fine_tune_answers_a_held_out_question(monkeypatch, smollm2):
    """``workbench demo``'s last part in this process: the loss falls and both answers print."""
    import torch

    from workbench.demo import finetune_demo

    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(smollm2.folder.parent.parent))
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside other tests' ranks a team of threads stalls at every barrier
    try:
        result = finetune_demo(steps=4, rows_per_step=4, held_out=8, out=out)
    finally:
        torch.set_num_threads(threads)
    print(out.getvalue())
    assert result["loss_after"] < result["loss_before"], result
    assert result["base"] and result["tuned"] and result["base"] != result["tuned"], result
    assert f"Q: {result['question']}" in out.getvalue()
