"""Low-resource inference: a model split over ranks, host and disk, generating for many
requests at once from a paged KV cache with continuous batching and prefix sharing.

    from kernels_runtime.inference import Engine, SamplingParams

    engine = Engine(model, "tp=2", kv_mem="256MiB", tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0.8))

The pieces, bottom to top: ``blocks`` (block pool, prefix index), ``kv_cache`` (the tensors),
``scheduler`` (what each step computes), ``batch`` (one step's flat row of tokens),
``attention`` (paged attention inside HF models), ``runner`` (a step through the parallelized
model, pipeline stages included), ``sampling``, ``engine`` (the API).
"""

from kernels_runtime.inference.engine import Engine, inference_problem
from kernels_runtime.inference.params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "inference_problem"]
