"""Low-resource inference: a model split over ranks, host and disk, generating for many
requests at once from a paged KV cache with continuous batching and prefix sharing.

    from kernels_runtime.inference import Engine, SamplingParams

    engine = Engine(model, "tp=2", kv_mem="256MiB", tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0.8))

The pieces, bottom to top: ``blocks`` (block pool, prefix index), ``kv_cache`` (the tensors),
``scheduler`` (what each step computes), ``batch`` (one step's flat row of tokens),
``attention`` (paged attention inside HF models), ``runner`` (a step through the parallelized
model, pipeline stages included), ``adapters`` (LoRA adapters mixed in one batch),
``sampling``, ``speculation`` / ``draft`` (drafted tokens verified in one forward),
``pipelined`` (pipeline stages with micro-batches in flight), ``engine_setup`` (what the engine
sets up once: the model parallelized for inference, the KV cache's size), ``engine`` (the API).
"""

from __future__ import annotations

from kernels_runtime._lazy import lazy_module as _lazy_module

_PUBLIC = {  # loaded on first use (PEP 562): the torch-free modules stay importable alone
    "Engine": "kernels_runtime.inference.engine",
    "inference_problem": "kernels_runtime.inference.plans",
    "RequestOutput": "kernels_runtime.inference.params",
    "SamplingParams": "kernels_runtime.inference.params",
}
__all__ = sorted(_PUBLIC)

__getattr__, __dir__ = _lazy_module(_PUBLIC, globals())
