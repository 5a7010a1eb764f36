"""The rank side of ``RemoteEngine``: generation whose progress the notebook can watch.

An inference ``Engine`` lives on the ranks (a ``%%colossal`` cell built it). ``generate_published``
runs its ``generate`` and, after every step, publishes the requests' text so far through
ipyparallel's datapub under ``GENERATION_KEY`` (the latest value per key reaches the notebook, so
each message holds every request's whole state, not a delta). One rank per replica publishes
(the first of its tensor and pipeline groups); every rank of a replica has the same tokens.
"""

from __future__ import annotations

import time
from typing import Any

GENERATION_KEY = "generation"


def _view(out: Any) -> dict[str, Any]:
    return {"text": out.text, "tokens": len(out.token_ids),
            "token_ids": out.token_ids[-64:] if out.text is None else None,
            "finish_reason": out.finish_reason, "error": out.error}


def generate_published(engine: Any, prompts: Any, params: Any = None, adapter: Any = None,
                       interval_s: float = 0.1) -> list:
    """``engine.generate(prompts, params, adapter=adapter)``, publishing the progress of this
    replica's requests at most every ``interval_s`` and once at the end."""
    from ipyparallel.datapub import publish_data

    from kernels_runtime.inference import Engine

    if not isinstance(engine, Engine):
        raise TypeError(f"RemoteEngine drives a kernels_runtime.inference.Engine; this rank's "
                        f"variable holds a {type(engine).__name__}")
    ctx = engine.ctx
    leader = ctx.coord("tp") == 0 and ctx.coord("pp") == 0
    state: dict[str, dict[str, Any]] = {}
    last = [0.0]

    def on_step(changed: list) -> None:
        for out in changed:
            state[out.request_id] = _view(out)
        now = time.monotonic()
        if leader and now - last[0] >= interval_s:
            publish_data({GENERATION_KEY: dict(state)})
            last[0] = now

    outputs = engine.generate(prompts, params, adapter=adapter, on_step=on_step)
    if leader:
        publish_data({GENERATION_KEY: dict(state)})
    return outputs
