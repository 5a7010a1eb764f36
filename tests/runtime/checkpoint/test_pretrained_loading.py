"""``load_pretrained``: a save_pretrained folder loaded shard-wise (meta model, each rank filling
only its pieces from the memory-mapped safetensors) is the same model as ``from_pretrained`` +
``parallelize_model`` on the same plan: the same pieces, bit for bit, and the same logits and
losses; and a rank's host memory grows by its share, not by a whole copy (measured: the
process's peak RSS, reset before the load).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kernels_runtime.checkpoint.format import CheckpointError

VOCAB = 131  # odd: tp=2 pads the vocabulary-parallel embedding with a row nobody loads
PLANS = ["tp=2", "dp=2 zero=3", "dp=2 zero=1", "pp=2 microbatches=2",
         "dp=2 zero=3 offload=auto device_mem=256MiB host_mem=1GiB"]
CACHE_ENV = "WORKBENCH_CACHE_DIR"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A random 4-layer LLaMA with tied embeddings and grouped key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    """A random 2-layer GPT-2: Conv1D weights stored (in, out), a fused q|k|v projection, an
    embedding tied to the head under other names than LLaMA's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    folder = tmp_path_factory.mktemp("tiny_gpt2")
    GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct (fp32), in ``$WORKBENCH_CACHE_DIR`` when set."""
    pytest.importorskip("gguf")
    from helpers import real_model

    root = None if os.environ.get(CACHE_ENV) else tmp_path_factory.mktemp("cache")
    return str(real_model.prepare(root).folder)


def _ids(vocab: int) -> torch.Tensor:
    return (torch.arange(24).view(2, 12) * 7 + 3) % vocab  # (batch 2, seq 12)


def _pieces(model) -> dict:
    return {(p.shard.name, p.shard.offsets, p.shard.sizes): p.values["param"].clone()
            for p in model.parallel_state.model_state.pieces(saving=False, optimizer=None)}


def _compare(a, b, plan: str, vocab: int) -> dict:
    from kernels_runtime import eval_step

    ids = _ids(vocab)
    pa, pb = _pieces(a), _pieces(b)
    out = {"keys_same": pa.keys() == pb.keys(), "pieces": len(pa),
           "values_same": all(torch.equal(pa[k], pb[k]) for k in pa if k in pb),
           "nonzero": sum(int(v.count_nonzero()) for v in pa.values())}
    batches = [(ids, ids)] * (2 if "pp=" in plan else 1)
    out["loss"] = (eval_step(a, batches), eval_step(b, batches))
    if "pp=" not in plan:  # a pipeline stage's forward is only part of the model
        with torch.no_grad():
            out["logits"] = float((a(ids).logits - b(ids).logits).abs().max())
    return out


def _parity(rank: int, world: int, folder: str, plan: str, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    from kernels_runtime.api import parallelize_model
    from kernels_runtime.checkpoint.pretrained import load_pretrained

    from helpers.distributed import context

    ctx = context(plan)
    ours = load_pretrained(folder, ctx=ctx, verbose=False)
    theirs = parallelize_model(AutoModelForCausalLM.from_pretrained(folder).eval(), ctx=ctx,
                               verbose=False)
    return _compare(ours, theirs, plan, vocab)


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["keys_same"] and r["values_same"] and r["pieces"] > 0, r
        assert r["nonzero"] > 0, r  # the values were read, not left at their zeros
        assert abs(r["loss"][0] - r["loss"][1]) <= 1e-6, r
        if "logits" in r:
            assert r["logits"] <= 1e-6, r


@pytest.mark.parametrize("plan", PLANS)
def test_shard_wise_load_is_from_pretrained_then_parallelize(ranks, tiny, plan):
    _check(ranks(2).run(_parity, tiny, plan, VOCAB, timeout_s=300))


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2 dp=2 zero=3", "tp=2 pp=2 microbatches=2",
                                  "pp=2 dp=2 zero=1 microbatches=2"])
def test_combined_plans_load_shard_wise_like_from_pretrained(ranks, tiny, plan):
    _check(ranks(4).run(_parity, tiny, plan, VOCAB, timeout_s=300))


@pytest.mark.parametrize("plan", ["tp=2", "dp=2 zero=3"])
def test_gpt2_loads_shard_wise_like_from_pretrained(ranks, tiny_gpt2, plan):
    _check(ranks(2).run(_parity, tiny_gpt2, plan, VOCAB, timeout_s=300))


def _training(rank: int, world: int, folder: str, plan: str, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    from kernels_runtime import parallelize, train_step
    from kernels_runtime.checkpoint.pretrained import load_pretrained_for_training

    from helpers.distributed import context

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)

    ctx = context(plan)
    ours, opt_a = load_pretrained_for_training(folder, adamw, ctx=ctx, verbose=False)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    theirs, opt_b = parallelize(plain, adamw(plain.parameters()), ctx=ctx, verbose=False)
    ids = _ids(vocab)
    pa, pb = _pieces(ours), _pieces(theirs)
    losses = [(train_step(ours, opt_a, [(ids, ids)]).loss,
               train_step(theirs, opt_b, [(ids, ids)]).loss)
              for _ in range(2)]
    after_a, after_b = _pieces(ours), _pieces(theirs)
    return {"keys_same": pa.keys() == pb.keys(), "pieces": len(pa),
            "values_same": all(torch.equal(pa[k], pb[k]) for k in pa if k in pb),
            "stepped_same": all(torch.allclose(after_a[k], after_b[k], atol=1e-6, rtol=0)
                                for k in after_a),
            "nonzero": sum(int(v.count_nonzero()) for v in pa.values()), "losses": losses}


@pytest.mark.parametrize("plan", ["dp=2 zero=2", "dp=2 zero=3"])
def test_training_twin_steps_like_parallelize(ranks, tiny, plan):
    for r in ranks(2).run(_training, tiny, plan, VOCAB, timeout_s=300):
        assert r["keys_same"] and r["values_same"] and r["pieces"] > 0 and r["nonzero"], r
        assert r["stepped_same"], r
        for a, b in r["losses"]:
            assert abs(float(a) - float(b)) <= 1e-6, r


@pytest.mark.slow
@pytest.mark.parametrize("plan,world", [("tp=3", 3), ("dp=2 zero=3", 2)])
def test_smollm2_shard_wise_load_is_from_pretrained_then_parallelize(ranks, smollm2_folder,
                                                                     plan, world):
    _check(ranks(world).run(_parity, smollm2_folder, plan, 49152, timeout_s=600))


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _peak_growth(rank: int, world: int, folder: str, plan: str, shard_wise: bool) -> dict:
    """Bytes the process's peak RSS rose by while loading (the peak is reset first), and the
    bytes of the pieces it holds after."""
    import safetensors.torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    from kernels_runtime.api import parallelize_model
    from kernels_runtime.checkpoint.pretrained import load_pretrained

    from helpers.distributed import context

    ctx = context(plan)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status()["VmRSS"]
    if shard_wise:
        model = load_pretrained(folder, ctx=ctx, verbose=False)
    else:
        model = parallelize_model(AutoModelForCausalLM.from_pretrained(folder), ctx=ctx,
                                  verbose=False)
    peak = _status()["VmHWM"] - base
    held = sum(v.numel() * v.element_size() for v in _pieces(model).values())
    return {"peak": peak, "held": held}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_a_rank_holds_its_share_not_a_copy(smollm2_folder):
    """Fresh rank processes for each way (an allocator keeps freed memory, which would hide
    the next load's growth): shard-wise, each rank's peak is about its half; from_pretrained
    then parallelize, the same measurement sees a whole copy."""
    from kernels_runtime.checkpoint.pretrained import weight_files

    from helpers.distributed import run_ranks

    copy = sum(f.stat().st_size for f in set(weight_files(smollm2_folder).values()))
    ours = run_ranks(_peak_growth, 2, smollm2_folder, "dp=2 zero=3", True, timeout_s=600)
    theirs = run_ranks(_peak_growth, 2, smollm2_folder, "dp=2 zero=3", False, timeout_s=600)
    for r in ours:
        assert abs(r["held"] - copy / 2) < 0.02 * copy, (r, copy)
        assert r["peak"] < 1.2 * r["held"], (r, copy)
    for r in theirs:
        assert r["peak"] > 0.9 * copy, (r, copy)


def test_a_folder_without_safetensors_is_refused(tmp_path):
    from kernels_runtime.checkpoint.pretrained import load_pretrained

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*safe_serialization=True"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path / "missing")


def test_a_config_without_a_causal_lm_class_is_refused(tmp_path):
    from safetensors.torch import save_file
    from transformers import ViTConfig

    from kernels_runtime.checkpoint.pretrained import load_pretrained

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=64).save_pretrained(tmp_path)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="AutoModelForCausalLM does not know.*model_class="):
        load_pretrained(tmp_path)
