"""``Engine(compile_model=True)``: the model's forward under ``torch.compile``, off by default.

Measured on this project's CPU host (GPT-2 h=256, 4 layers, fp32, one thread, 48 requests of
``bench inference``'s workload): compiled steps took 2.9-3.1 CPU seconds against 2.5 eager
(slower: the paged attention is a graph break in every layer, so a step runs five compiled
graphs, each with its guards, around Python that dominates anyway), after 150 s of compiling;
greedy tokens were identical. So it is an option, for a host where it wins (a GPU, or a bigger
model whose matmuls and fusions outweigh the breaks): measure there before turning it on.

The token dimension varies every step (decodes and prompt chunks of any length), so the model
is compiled with dynamic shapes (``dynamic=True``) rather than recompiled per step length. The
paged attention (a Python loop over the step's sequences, ``attention.py``) is kept out of the
graph with ``torch.compiler.disable``: traced, it would specialise on the batch's composition
and recompile nearly every step.
"""

from __future__ import annotations

from typing import Any

import torch


def compile_runner(runner: Any) -> None:
    """Compile ``runner``'s model forward in place (``runner.model`` becomes the compiled
    module; the parameters stay shared). HF decoders on one pipeline stage only."""
    if runner.config is None:
        raise ValueError("compile_model=True is for HF decoders (their attention goes through "
                         "transformers' attention interface); this decoder's attention calls "
                         "are routed by a torch function mode, which torch.compile does not "
                         "trace: leave compile_model off")
    if runner.pp > 1:
        raise ValueError("compile_model=True runs with pp=1 only (a pipeline stage ends its "
                         "forward by an exception, which would break every graph): leave it "
                         "off, or use a plan without pp")
    # the paged attention is registered behind torch.compiler.disable (attention.install)
    runner.model = torch.compile(runner.model, dynamic=True)
