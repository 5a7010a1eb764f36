"""``Engine(compile_model=True)`` (``compiled.py``) greedy-decodes the same tokens as the eager
engine, over steps mixing prompt chunks and decodes of different lengths (the token dimension
is dynamic), with prefix sharing on (shared blocks are gathered, not read in place).

A fresh interpreter, as ``test_plain_process.py`` does: compiling takes minutes on a loaded
2-core host, so ``full``. Speed is not asserted (``bench inference`` and ``compiled.py``'s
docstring hold the measurement)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.full]

CODE = r"""
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime.inference import Engine, SamplingParams

torch.manual_seed(0)
torch.set_num_threads(1)
# a wide initialisation keeps the logits of random weights far from ties
model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=128, n_embd=32, n_layer=2,
                                   n_head=4, initializer_range=0.2, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)).eval()
g = torch.Generator().manual_seed(1)
system = torch.randint(1, 128, (20,), generator=g).tolist()
prompts = [system + torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 11, 30, 7)]
params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 5, 9, 16)]
got = {}
for compiled in (False, True):
    engine = Engine(model, kv_mem="256KiB", max_num_seqs=3, max_batch_tokens=24,
                    compile_model=compiled, verbose=False)
    got[str(compiled)] = [o.token_ids for o in engine.generate(prompts, params)]
    hits = engine.stats()["prefix_hit_blocks"]
print(json.dumps({"eager": got["False"], "compiled": got["True"], "hits": hits}))
"""


def test_compiled_engine_decodes_the_tokens_of_the_eager_one():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["hits"] > 0  # the shared system prompt's blocks were shared
    assert [len(t) for t in out["eager"]] == [12, 5, 9, 16]
    assert out["compiled"] == out["eager"]
