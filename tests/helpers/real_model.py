"""SmolLM2-135M-Instruct, converted once per test session, and chat prompts for it.

Real weights carry what toy configs miss (9 query heads over 3 key/value heads, tied
embeddings, a chat template whose end-of-turn token is the eos), and greedy parity on them means
something: a trained model's logits are rarely near-ties. The cache is ``$WORKBENCH_CACHE_DIR``
when it is set (converted once per machine), else a folder of the test session.

Before converting, ``prepare`` leaves two temporary folders beside the model's, as killed
conversions would: one an hour old (dead: the conversion must remove it) and one fresh (maybe
another process's live conversion: it must stay). Neither holds a manifest; both hold a config
and a truncated weight file, the parts that would load if anything took them for the model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from workbench.models import cache, smollm2

NEW = 24  # new tokens per chat answer (most stop earlier, at the end-of-turn token)
QUESTION = "What is the capital of France?"
# short, factual, different in form, so the answers differ in length and content
CHAT = [
    QUESTION,
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the ocean.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into French.",
]


@dataclass
class Prepared:
    folder: Path
    seconds: float  # the first call's time: conversion, or 0-ish when the cache had it
    dead: Path  # the planted temporary folders
    live: Path
    converted: bool


def _plant(path: Path, age_s: float) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)  # truncated
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def prepare(cache_dir: Path) -> Prepared:
    """Plant a dead and a live temporary folder, then convert (or find) the model."""
    target = cache.model_dir(smollm2.NAME, cache_dir)
    converted = not cache.ready(target)
    prefix = cache.temp_prefix(target)
    dead = _plant(target.parent / f"{prefix}killed", age_s=2 * cache.STALE_S)
    live = _plant(target.parent / f"{prefix}live-{os.getpid()}", age_s=0)
    start = time.perf_counter()
    folder = smollm2.smollm2_instruct(cache_dir)
    return Prepared(folder, time.perf_counter() - start, dead, live, converted)


def load(folder: str | Path):
    """The model as saved (fp32), in eval mode, with plain transformers: no gguf."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def chat_ids(folder: str | Path, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn, with the model's own chat template and its generation
    prompt (the assistant turn's opening)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def hf_greedy(folder: str | Path, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """HF ``generate``'s greedy new tokens for each prompt, end-of-turn token included when it
    stopped there (all 30 layers: ~7 s for the six chat prompts on 2 idle cores)."""
    import torch

    model = load(folder)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out
