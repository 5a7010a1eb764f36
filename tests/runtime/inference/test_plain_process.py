"""The runtime's first calls work in a plain Python process, as vLLM's ``LLM(model)`` does.

Each case runs in a fresh ``python -c`` (so no torch.distributed group exists, no pool, no
torchrun): ``Engine(model)`` greedy-decodes the tokens of HF ``generate``, on a private group
of one rank; on a CPU host its default KV cache takes at most a quarter of the host's
memory (it took every sequence at 4096 tokens: 5.6 GiB per rank for SmolLM2-135M);
``parallelize(model, opt, "zero=0")`` trains 3 SGD steps with the losses of the plain model; a
plan needing two ranks is refused with a message saying where ranks come from.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# each test is a fresh interpreter (~4.5 s): make test, not the inner loop
pytestmark = pytest.mark.slow

PRELUDE = r"""
import json

import torch
import torch.distributed as dist

assert not dist.is_initialized()
torch.manual_seed(0)
"""

ENGINE = PRELUDE + r"""
from transformers import LlamaConfig, LlamaForCausalLM

from kernels_runtime.inference import Engine, SamplingParams

# a wide initialisation keeps the logits of random weights far from ties, so greedy decoding
# compares the two implementations rather than rounding noise
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
prompts = [[5, 17, 42, 9], [3, 99, 7, 64, 12, 8, 1, 77, 30]]
with torch.no_grad():
    expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
engine = Engine(model, verbose=False)
got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=12))]
print(json.dumps({"expected": expected, "got": got, "world": dist.get_world_size()}))
"""

TRAIN = PRELUDE + r"""
import copy

from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime import parallelize, train_step

model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
plain = copy.deepcopy(model)
batches = [torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(s))
           for s in range(3)]
opt = torch.optim.SGD(plain.parameters(), lr=0.1)
expected = []
for ids in batches:
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    expected.append(loss.item())
model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero=0",
                         verbose=False)
got = [train_step(model, opt, [{"input_ids": ids, "labels": ids}]).loss for ids in batches]
print(json.dumps({"expected": expected, "got": got, "world": dist.get_world_size()}))
"""

TWO_RANKS = PRELUDE + r"""
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime import parallelize

model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4))
try:
    parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), "dp=2")
except RuntimeError as err:
    print(json.dumps({"error": str(err), "initialised": dist.is_initialized()}))
"""


KV_DEFAULT = PRELUDE + r"""
import psutil
from transformers import LlamaConfig, LlamaForCausalLM

from kernels_runtime.inference import Engine

# 64 layers of one 1024-wide key/value head: 512 KiB of cache per token, so the default of
# 32 sequences x 4096 tokens (64 GiB) is far more than a CPU host can give
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=64,
    num_attention_heads=1, num_key_value_heads=1, head_dim=1024,
    max_position_embeddings=4096)).eval()
engine = Engine(model, verbose=False)
print(json.dumps({"kv_mem": engine.kv_mem, "available": psutil.virtual_memory().available,
                  "total": psutil.virtual_memory().total}))
"""


def _run(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_engine_runs_on_one_rank_and_decodes_like_hf_generate():
    out = _run(ENGINE)
    assert out["world"] == 1
    assert out["got"] == out["expected"]


def test_parallelize_zero0_trains_like_the_plain_model():
    out = _run(TRAIN)
    assert out["world"] == 1
    pairs = zip(out["got"], out["expected"], strict=True)
    assert all(abs(a - b) <= 1e-6 for a, b in pairs), out


def test_a_plan_of_two_ranks_says_to_start_a_pool_or_use_torchrun():
    out = _run(TWO_RANKS)
    assert "needs 2 ranks" in out["error"]
    assert "%colossal start -n 2" in out["error"] and "torchrun" in out["error"]
    assert not out["initialised"]  # refused before any group was made


def test_the_default_kv_cache_on_a_cpu_host_takes_half_its_free_memory_at_most():
    out = _run(KV_DEFAULT)
    assert out["total"] < 64 * 2**30, "the model's default wish must exceed this host"
    # half of what was free when the engine measured; free memory moves with other processes
    assert 0 < out["kv_mem"] <= out["total"] // 2, out
