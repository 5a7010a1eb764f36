"""LoRA adapters served by the engine: requests naming different adapters, and the base model,
share one batch, and each gets the greedy tokens of HF ``generate`` on the model with its own
adapter merged in, under every plan the engine serves adapters with, and over oneDNN-packed base
linears (``pack_weights=True``).

What is protected: ``Engine(model, plan, adapters={"a": dir, "b": dir})`` loads peft's adapter
folders (random factors on every attention and MLP projection, ``helpers/adapters.py``);
``generate(prompts, adapter=[...])`` mixes a, b and the base in the same steps (observed on
the adapter routing of every step) and each request's tokens equal ``merge_and_unload``'s
``generate`` on that prompt alone; the prefix cache never hands one adapter's keys and values to
another (a prompt sharing a's first two blocks under b, and a's prompt again under the base,
find none of a's blocks and match their own references; under a again it finds both); an
unknown adapter name is that request's error, naming the adapters served; a folder the engine
cannot serve (DoRA, not a peft folder), and a plan offloading the weights, are refused with
what to do. Model: a small LLaMA
(grouped-query) with a wide initialisation, which keeps random logits far from ties (as
``test_plain_process.py``), fp32; the real SmolLM2 is in
``tests/workbench/serving/test_lora_serving.py``.
"""

from __future__ import annotations

import json

import pytest

from helpers import adapters as lora
from helpers.distributed import process_comm

NEW = 16
WHICH = ["a", None, "b", "a", "b"]  # each prompt's adapter: the base between two adapters


def _model(path: str | None = None):
    """The small LLaMA, its weights from ``path`` (else the seeded initialisation)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    if path is not None:
        model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 9, 23, 17)]
    out.append(out[0][:32] + [7, 3, 99, 12, 64, 5])  # a's first two blocks, under b
    return out


def _run(rank: int, world: int, path: str, plan: str, adapters: dict[str, str],
         pack: bool = False) -> dict:
    from kernels_runtime.inference import Engine, SamplingParams

    engine = Engine(_model(path), plan, comm=process_comm(), kv_mem="1MiB",
                    adapters=adapters, pack_weights=pack, verbose=False)
    steps: list[list[int]] = []  # the adapter slots present in each step's tokens
    routing = engine.adapters.routing

    def observed(slots):  # records what the engine routes, then routes it
        steps.append(sorted(set(slots.tolist())) if slots is not None else [-1])
        return routing(slots)

    engine.adapters.routing = observed
    params = SamplingParams(max_new_tokens=NEW)
    prompts = _prompts()
    outs = engine.generate(prompts, params, adapter=WHICH)
    hits = [engine.stats()["prefix_hit_blocks"]]
    # prompt 0 again, under the base (its cached blocks are a's), then under a
    again = []
    for name in (None, "a"):
        again.append(engine.generate([prompts[0]], params, adapter=name)[0])
        hits.append(engine.stats()["prefix_hit_blocks"])
    unknown = engine.generate([prompts[1]], params, adapter="c")[0]
    return {"tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs],
            "again": [o.token_ids for o in again], "steps": steps,
            "hits": hits, "unknown": unknown.error, "leader_steps": engine.stats()["steps"]}


_REFERENCE: dict[str, dict] = {}


def _reference(folder) -> dict:
    """The model's weights and adapters (made once per session) and every prompt's
    merged-model tokens."""
    import torch

    if not _REFERENCE:
        model = _model()
        torch.save(model.state_dict(), folder / "llama.pt")
        adapters = lora.make_adapters(model, folder)
        prompts = _prompts()
        want = {name: lora.merged_greedy(model, adapters.get(name), prompts, NEW)
                for name in ("a", "b", None)}
        _REFERENCE.update(path=str(folder / "llama.pt"), adapters=adapters, want=want)
    return _REFERENCE


# "packed weights": the base linears oneDNN-packed (``packed_linear.py``), the adapters' terms
# added to what the packed layer computes
PLANS = {"one rank": ("dp=1", 1), "tp=2": ("tp=2", 2), "dp=2": ("dp=2", 2),
         "pp=2": ("pp=2", 2), "packed weights": ("dp=1", 1)}


@pytest.mark.full
@pytest.mark.parametrize("case", list(PLANS))
def test_mixed_adapters_in_one_batch_equal_merged_generate(ranks, tmp_path_factory, case):
    plan, n = PLANS[case]
    ref = _reference(tmp_path_factory.mktemp("adapters"))
    want = ref["want"]
    # the adapters change the answers (else parity would prove nothing)
    assert want["a"] != want[None] and want["b"] != want[None] and want["a"] != want["b"]
    results = ranks(n).run(_run, ref["path"], plan, ref["adapters"], case == "packed weights",
                           timeout_s=300)
    for rank, got in enumerate(results):
        assert got["errors"] == [None] * len(WHICH), got["errors"]
        for i, name in enumerate(WHICH):
            assert got["tokens"][i] == want[name][i], f"rank {rank}: prompt {i} ({name})"
        # a, b and the base were computed in the same step (this replica's share under dp)
        mine = {WHICH[i] for i in range(len(WHICH)) if i % (2 if case == "dp=2" else 1)
                == (rank if case == "dp=2" else 0)}
        slots = sorted({-1 if a is None else "ab".index(a) for a in mine})
        assert slots in got["steps"], (rank, got["steps"])
        assert got["again"] == [want[None][0], want["a"][0]], rank
        assert got["unknown"] == ("unknown adapter 'c': this engine serves 'a', 'b' (and the "
                                  "base model, adapter=None)")
        if case != "dp=2" or rank == 0:  # prompt 0 ran on this replica
            first, base, again_a = got["hits"]
            assert (base - first, again_a - base) == (0, 2), got["hits"]  # 40 tokens: 2 blocks
    print(f"{case}: steps {results[0]['leader_steps']}, mixed steps "
          f"{sum(len(s) > 1 for s in results[0]['steps'])}")


def _dora_folder(tmp_path):
    folder = tmp_path / "dora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_dora": True}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_an_adapter_folder_the_engine_cannot_serve_says_what_to_do(tmp_path):
    from kernels_runtime.inference.adapters import AdapterError, read_adapter

    with pytest.raises(AdapterError, match=r"adapter 'x' uses DoRA, which the engine does not "
                                           r"serve; merge it into the model"):
        read_adapter(_dora_folder(tmp_path), "x")
    with pytest.raises(AdapterError, match=r"is not a peft adapter folder \(it needs "
                                           r"adapter_config.json"):
        read_adapter(tmp_path / "nowhere", "y")


def _offloaded(rank: int, world: int, path: str, adapters: dict[str, str]) -> str:
    from kernels_runtime.inference import Engine
    from kernels_runtime.inference.adapters import AdapterError

    try:
        Engine(_model(path), "zero=3 offload=static offload_params=1", comm=process_comm(),
               kv_mem="1MiB", adapters=adapters, verbose=False)
    except AdapterError as err:
        return str(err)
    return "served"


@pytest.mark.full
def test_adapters_over_offloaded_weights_are_refused_naming_the_plans_that_work(
        ranks, tmp_path_factory):
    ref = _reference(tmp_path_factory.mktemp("adapters"))
    said = ranks(1).run(_offloaded, ref["path"], ref["adapters"], timeout_s=300)[0]
    assert said == ("LoRA adapters are served from whole or tensor-parallel weights; offload "
                    "and zero=3 gather weights unit by unit, which the adapter layers do not "
                    "follow: use tp, pp or dp replicas")
