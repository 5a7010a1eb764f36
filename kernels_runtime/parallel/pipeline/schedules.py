"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it runs.

An action is a forward (``F``), a backward (``B``: input and weight gradients; under ``zbv``
only the input gradient) or a weight-gradient step (``W``, ``zbv`` only) of one micro-batch on
one of the rank's model chunks. Which virtual stage a chunk is, and so where its input comes
from and its output goes, is the schedule's ``Placement``:

- ``gpipe`` (Huang et al. 2019): every forward, then every backward; m micro-batches in flight.
- ``1f1b`` (PipeDream-flush, Narayanan et al. 2021): p - s - 1 warm-up forwards on stage s,
  then one forward and one backward alternately; at most p micro-batches in flight.
- ``interleaved`` (Narayanan et al. 2021): V chunks per rank, chunk c of rank r being virtual
  stage c*p + r; micro-batches run in rounds of p per chunk; the bubble shrinks by V.
- ``zbv`` (zero-bubble V, Qi et al. 2024): 2 chunks per rank in a V (rank r holds virtual
  stages r and 2p-1-r, so the first rank also computes the loss); B computes only the input
  gradient and the weight gradients (W) fill what would be bubbles. Its order is found by list
  scheduling (``zero_bubble_v``) with the costs of F, B and W (unit costs first, then the
  ones the first step measured): B first, then F while the in-flight activations stay within
  1F1B's, then W.
- ``forward_only``: forwards in order, for evaluation and the inference engine.

The lists are plain tuples with no torch, so schedules are checked and replayed
(``simulate.py``) without processes; the executor runs them as given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    chunk: int  # the rank's model chunk
    mb: int  # micro-batch index

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Placement:
    """Which rank runs which virtual stage: ``p`` ranks, ``chunks`` chunks each."""

    p: int
    chunks: int = 1
    v_shape: bool = False  # zbv: chunk 1 runs back up the ranks

    @property
    def stages(self) -> int:
        return self.p * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def owner(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) of a virtual stage."""
        if self.v_shape:
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        chunk, rank = divmod(stage, self.p)
        return rank, chunk


@dataclass(frozen=True)
class Schedule:
    name: str
    placement: Placement
    orders: tuple[tuple[Action, ...], ...]  # per pipeline rank
    split_backward: bool = False  # B is the input gradient only; W the weight gradient

    @property
    def microbatches(self) -> int:
        return 1 + max((a.mb for order in self.orders for a in order), default=-1)


def gpipe(p: int, m: int) -> Schedule:
    orders = tuple(tuple([Action("F", 0, i) for i in range(m)]
                         + [Action("B", 0, i) for i in range(m)]) for _ in range(p))
    return Schedule("gpipe", Placement(p), orders)


def one_f_one_b(p: int, m: int) -> Schedule:
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [Action("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", 0, warmup + i), Action("B", 0, i)]
        order += [Action("B", 0, i) for i in range(m - warmup, m)]
        orders.append(tuple(order))
    return Schedule("1f1b", Placement(p), tuple(orders))


def interleaved(p: int, m: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: the k-th forward of a rank is chunk (k // p) % V of
    micro-batch (k // pV) * p + k % p; backwards walk the chunks in reverse."""
    if m % p:
        raise ValueError(f"interleaved needs micro-batches ({m}) a multiple of stages ({p})")
    total = m * chunks

    def forward(k: int) -> Action:
        return Action("F", (k // p) % chunks, (k // (p * chunks)) * p + k % p)

    def backward(k: int) -> Action:
        return Action("B", chunks - 1 - (k // p) % chunks, (k // (p * chunks)) * p + k % p)

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (chunks - 1) * p, total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return Schedule("interleaved", Placement(p, chunks), tuple(orders))


@functools.lru_cache(maxsize=256)  # schedules are immutable; planners ask for the same ones
def zero_bubble_v(p: int, m: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
                  ) -> Schedule:
    """ZB-V by list scheduling with the (F, B, W) cost of a chunk action (unit costs unless
    measured ones are given): the rank that is free first takes a ready B, else a ready F
    while it holds fewer than 2p chunk activations (1F1B's peak: p micro-batches of a whole
    stage), else a pending W; with nothing ready it waits for the next action to finish.
    Below ``warm`` held activations a ready F goes before a ready B (a deeper warm-up pays
    when W is small next to B); of these orders, and the one running each W right after its
    B, the one with the shortest step at these costs wins."""
    best: tuple[float, Schedule] | None = None
    # warm-up depths, and -1: every W right after its B (a V-shaped 1F1B, the best order when
    # W is too small next to B to fill anything)
    for warm in sorted({-1, 0, p // 2, p, 2 * p}):
        makespan, schedule = _list_schedule(p, m, costs, warm)
        if best is None or makespan < best[0] - 1e-9:
            best = makespan, schedule
    assert best is not None
    return best[1]


def _list_schedule(p: int, m: int, costs: tuple[float, float, float],
                   warm: int) -> tuple[float, Schedule]:
    place = Placement(p, 2, v_shape=True)
    last = place.stages - 1
    cost = dict(zip("FBW", costs))
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
    next_f = [[0, 0] for _ in range(p)]  # per rank and chunk: next micro-batch to forward
    next_b = [[0, 0] for _ in range(p)]
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    held = [0] * p  # chunk activations kept for backward (F done, W not yet)
    orders: list[list[Action]] = [[] for _ in range(p)]
    free = [0.0] * p
    while any(len(o) < 6 * m for o in orders):
        active = [r for r in range(p) if len(orders[r]) < 6 * m]
        t = min(free[r] for r in active)
        now = [r for r in active if free[r] <= t + 1e-9]
        choice = None
        for r in now:
            action = _pick(r, place, last, m, next_f, next_b, pending_w, held,
                           lambda key, t=t: done.get(key, float("inf")) <= t + 1e-9, p, warm)
            if action is not None:
                choice = r, action
                break
        later = [v for v in [*done.values(), *free] if v > t + 1e-9]
        if choice is None and later:  # nobody free now can act: they wait for the next finish
            for r in now:
                free[r] = min(later)
            continue
        if choice is None:  # every rank waits on the memory cap: the first one exceeds it
            for r in now:
                action = _pick(r, place, last, m, next_f, next_b, pending_w, held,
                               lambda key, t=t: done.get(key, float("inf")) <= t + 1e-9,
                               10 * p * m, warm)
                if action is not None:
                    choice = r, action
                    break
            if choice is None:
                raise RuntimeError("zbv list scheduling made no progress")  # a bug
        r, action = choice
        orders[r].append(action)
        done[(action.kind, place.stage(r, action.chunk), action.mb)] = t + cost[action.kind]
        free[r] = t + cost[action.kind]
        if action.kind == "F":
            next_f[r][action.chunk] += 1
            held[r] += 1
        elif action.kind == "B":
            next_b[r][action.chunk] += 1
            pending_w[r].append(Action("W", action.chunk, action.mb))
        else:
            held[r] -= 1
    schedule = Schedule("zbv", place, tuple(tuple(o) for o in orders), split_backward=True)
    return max(free), schedule


def _pick(r, place, last, m, next_f, next_b, pending_w, held, ready, cap,
          warm) -> Action | None:
    if warm < 0 and pending_w[r]:
        return pending_w[r].pop(0)
    if held[r] < warm:
        forward = _forward(r, place, m, next_f, ready)
        if forward is not None:
            return forward
    for chunk in (1, 0):  # the deeper chunk's backward frees memory and feeds the other
        i = next_b[r][chunk]
        stage = place.stage(r, chunk)
        if i < m:
            after = ("F", stage, i) if stage == last else ("B", stage + 1, i)
            if ready(after) and ready(("F", stage, i)):
                return Action("B", chunk, i)
    if held[r] < 2 * cap:
        forward = _forward(r, place, m, next_f, ready)
        if forward is not None:
            return forward
    if pending_w[r]:
        return pending_w[r].pop(0)
    return None


def _forward(r, place, m, next_f, ready) -> Action | None:
    for chunk in (1, 0):
        i = next_f[r][chunk]
        stage = place.stage(r, chunk)
        if i < m and (stage == 0 or ready(("F", stage - 1, i))):
            return Action("F", chunk, i)
    return None


def forward_only(p: int, m: int, chunks: int = 1, v_shape: bool = False) -> Schedule:
    """Every forward, chunk by chunk: a rank's first chunk runs all micro-batches while the
    later stages start on them (on the V placement too)."""
    orders = tuple(tuple(Action("F", c, i) for c in range(chunks) for i in range(m))
                   for _ in range(p))
    return Schedule("forward_only", Placement(p, chunks, v_shape), orders)


def build(name: str, p: int, m: int, chunks: int = 1,
          costs: tuple[float, float, float] | None = None) -> Schedule:
    """The schedule ``name`` (a plan's ``pp_schedule``) for p ranks and m micro-batches;
    ``costs`` (F, B, W of a chunk action) shape the zbv order."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, chunks)
    if name == "zbv":
        return zero_bubble_v(p, m, costs or (1.0, 1.0, 1.0))
    if name == "forward_only":
        return forward_only(p, m, chunks)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose gpipe, 1f1b, interleaved, "
                     "zbv or forward_only")
