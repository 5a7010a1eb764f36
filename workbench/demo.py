"""The end of ``workbench demo``: a real model learns something, and a person can read what.

Why it exists: the demo's notebooks train a tiny GPT-2 from scratch, whose samples are noise to
anyone but its author. This last part fine-tunes the real SmolLM2-135M-Instruct (converted once
from PyPI, ``workbench.models``) with LoRA for a few steps on questions about standard-library
functions answered from their docstrings (``kernels_runtime.data.stdlib_qa``), in this process
on one rank (``parallelize(..., "zero=0")``, ``fit``), then prints its greedy answer to a
held-out question (a function it never saw) beside the base model's and the docstring's.
Notebook 10 does the same on a pool, then exports and serves the adapter.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, TextIO

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _greedy(model: Any, tokenizer: Any, question: str, max_new_tokens: int) -> str:
    """The model's greedy answer to one user turn, through the chat template."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    prompt = torch.tensor([ids])  # (1, s)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()


def finetune_demo(steps: int = 12, rows_per_step: int = 8, held_out: int = 16,
                  question_index: int = 0, max_new_tokens: int = 40,
                  out: TextIO | None = None) -> dict[str, Any]:
    """Fine-tune SmolLM2's LoRA adapters for ``steps`` steps and print the held-out loss before
    and after and one held-out answer, base beside fine-tuned; what was printed, as a dict."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernels_runtime import evaluate, fit, parallelize
    from kernels_runtime.data import chat_examples, eval_batches, train_batches
    from kernels_runtime.data.stdlib_qa import stdlib_qa
    from workbench.models import smollm2_instruct

    if steps < 1 or rows_per_step < 1 or held_out < 1:
        raise ValueError(f"steps, rows_per_step and held_out must be >= 1, got {steps}, "
                         f"{rows_per_step}, {held_out}")

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    start = time.perf_counter()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")  # peft calls it
    folder = smollm2_instruct()
    train_rows, held_rows = stdlib_qa()
    question = held_rows[question_index]["messages"][0]["content"]
    say(f"\n== fine-tuning SmolLM2-135M-Instruct with LoRA: {steps} steps of {rows_per_step} "
        f"questions about the standard library, answered from its docstrings")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                      target_modules=TARGETS))
    base_answer = _greedy(model, tokenizer, question, max_new_tokens)  # B = 0: the base model
    model, optimizer = parallelize(model, torch.optim.AdamW(model.parameters(), lr=2e-3),
                                   "zero=0", verbose=False)
    pad = tokenizer.pad_token_id
    held = eval_batches(chat_examples(tokenizer, held_rows[:held_out]), 8, 0, 1, pad)
    before = evaluate(model, held, progress=False)["loss"]
    # no warm-up: B starts at zero, so the first steps are small anyway, and a demo has few
    scheduler = transformers.get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=0,
                                           num_training_steps=steps)
    batches = train_batches(chat_examples(tokenizer, train_rows), rows_per_step, 0, 1, pad)
    history = fit(model, optimizer, batches, steps=steps, scheduler=scheduler,
                  eval_batches=held)  # a progress bar on stderr
    after = history.eval[-1]["loss"]
    tuned_answer = _greedy(model, tokenizer, question, max_new_tokens)
    say(f"held-out loss (questions about {held_out} other functions): {before:.3f} -> "
        f"{after:.3f}")
    say(f"\nQ: {question}")
    docstring = held_rows[question_index]["messages"][1]["content"]
    for label, text in [("SmolLM2 as released:", base_answer),
                        (f"after {steps} LoRA steps:", tuned_answer),
                        ("the docstring says:", docstring)]:
        say(f"  {label:<24}{text}")
    seconds = time.perf_counter() - start
    say(f"({seconds:.0f} s; notebooks/10_finetune.ipynb trains on a pool of ranks, exports the "
        "adapter and serves it to the openai client)")
    return {"question": question, "base": base_answer, "tuned": tuned_answer,
            "loss_before": before, "loss_after": after, "seconds": seconds}


def main() -> None:
    """``python -m workbench.demo``: the fine-tuning part alone."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    finetune_demo()


if __name__ == "__main__":
    main()
