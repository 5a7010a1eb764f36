"""``RemoteEngine``: the notebook's handle on an inference engine that lives on the ranks.

A ``%%colossal`` cell builds the engine on every rank (``engine = Engine(model, "tp=2", ...)``:
the model never leaves the ranks); the notebook then sends it requests::

    llm = RemoteEngine("engine")
    outputs = llm.generate(["def parse(", "class Stack:"], SamplingParams(max_new_tokens=64))

``generate`` runs like a ``%%colossal`` cell (the same failure handling: a rank's error or death
is reported by rank, an interrupt stops every rank), streams each request's text into the
cell's output as the ranks produce it, shows the live dashboard (its inference panel: tokens/s,
queue, KV blocks), and returns one ``RequestOutput`` per prompt, in order.
"""

from __future__ import annotations

import time
from typing import Any

from IPython.display import display

from workbench.cells.execution import run_cell
from workbench.cells.session import active_magics, active_pool
from workbench.errors import PoolError
from workbench.inference.generation_calls import GENERATION_KEY
from workbench.pool.pool import Pool
from workbench.ui.dashboard import LiveDashboard

_ARGS, _OUT = "_workbench_generate_args", "_workbench_generate_outputs"


class TokenView:
    """The requests' text so far, one line each, in one display updated in place: the
    ``data_sink`` that turns what the ranks publish into streamed output."""

    def __init__(self, show: bool = True, interval_s: float = 0.2) -> None:
        self.show, self.interval_s = show, interval_s
        self.requests: dict[str, dict[str, Any]] = {}
        self.handle: Any = None
        self._shown = 0.0

    def __call__(self, data: dict[int, dict[str, Any]], final: bool) -> None:
        for values in data.values():
            self.requests.update(values.get(GENERATION_KEY) or {})
        if not self.show or not self.requests:
            return
        now = time.monotonic()
        if final or now - self._shown >= self.interval_s:
            self._shown = now
            if self.handle is None:
                self.handle = display(_Text(self.render()), display_id=True)
            else:
                self.handle.update(_Text(self.render()))

    def render(self) -> str:
        lines = []
        for rid in sorted(self.requests, key=lambda r: int(r.rsplit("-", 1)[1])):
            r = self.requests[rid]
            body = r["text"] if r["text"] is not None else f"token ids ...{r['token_ids']}"
            end = f"  [{r['finish_reason']}]" if r["finish_reason"] else ""
            if r["error"]:
                body, end = f"error: {r['error']}", ""
            lines.append(f"[{rid.rsplit('-', 1)[1]}] {body!r}{end}")
        return "\n".join(lines)


class _Text:
    """Plain text for ``display`` (the repr is the text itself, not quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _Both:
    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def __call__(self, data: dict[int, dict[str, Any]], final: bool) -> None:
        for sink in self.sinks:
            sink(data, final)


class RemoteEngine:
    """Send requests to the ``Engine`` held by the rank variable ``name``."""

    def __init__(self, name: str = "engine", pool: Pool | None = None) -> None:
        if not name.isidentifier():
            raise ValueError(f"{name!r} is not a variable name")
        self.name, self._pool = name, pool
        self.last_run: Any = None  # the dashboard history of the last call

    @property
    def pool(self) -> Pool:
        pool = self._pool or active_pool()
        if pool is None or not pool.started:
            raise PoolError("no pool is running: start one with `%colossal start` and build "
                            f"the engine in a %%colossal cell ({self.name} = Engine(...))")
        return pool

    def generate(self, prompts: Any, params: Any = None, *, adapter: Any = None,
                 show: bool = True, dashboard: str = "auto",
                 timeout_s: float | None = None) -> list:
        """One ``RequestOutput`` per prompt (the same call as ``Engine.generate`` on every
        rank, ``adapter`` naming LoRA adapters as there); with ``show`` each request's text
        streams into the cell as it grows."""
        from workbench.serving.magic import guard_cell

        pool = self.pool
        magics = active_magics()
        if magics is not None and magics.pool is pool:
            guard_cell(magics)  # the ranks run an endpoint's serving loop
        pool.view().push({_ARGS: (prompts, params, adapter)}, block=True)
        tokens = TokenView(show)
        live = LiveDashboard(list(range(pool.world_size)), mode=dashboard,
                             label=f"{self.name}.generate")
        self.last_run = live.history
        if magics is not None:
            magics.last_run = live.history  # workbench.show_dashboard() shows this call's run
        live.start()
        code = (f"import workbench.inference.generation_calls as _wb_calls\n"
                f"{_OUT} = _wb_calls.generate_published({self.name}, *{_ARGS})\n")
        run_cell(pool, code, stream=_print, display=_ignore, timeout_s=timeout_s,
                 data_sink=_Both(live, tokens))
        return pool.view([0]).pull(_OUT, block=True)[0]


def _print(rank: int, name: str, text: str) -> None:
    if rank == 0:
        print(text, end="")


def _ignore(rank: int, content: dict[str, Any]) -> None:
    return None
