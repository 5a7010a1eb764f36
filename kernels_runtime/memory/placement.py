"""Where each payload lives: static homes from fractions, or automatic under budgets.

Static (``offload=static``): each kind of model state keeps a fraction of its chunks off the
device (``offload_params``, ``offload_grads``, ``offload_optim``), the first chunks in chunk
order; those go to host memory while ``host_mem`` lasts, the rest to disk. A payload used on
the device goes back to its home afterwards.

Automatic (``offload=auto``): payloads stay where they were last used until room is needed.
Then the resident payload whose next use lies furthest in the future is evicted one tier down
(Belady's rule: optimal for a known sequence). The sequence is known: a training step touches
the same payloads in the same order every time, so the trace of one step predicts the next
(before the first, the order units were registered in stands in). Budgets are per rank:
``device_mem`` (default: the device's capacity; on a CPU-only machine the device tier is this
account, unlimited unless given) and ``host_mem`` (default unlimited); beyond both, disk.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable

from kernels_runtime.byte_sizes import human_bytes
from kernels_runtime.memory.tiers import Payload, Tier, TierStore


class BudgetError(RuntimeError):
    """A per-tier budget that cannot hold what one step needs at once."""


def static_homes(sizes: list[int], fraction: float, host_left: list[float]) -> list[Tier]:
    """Homes of one kind's payloads (sizes in chunk order): the first ``fraction`` of the bytes
    off the device, to the host while ``host_left[0]`` bytes remain there (consumed), then to
    disk."""
    total, off, homes = sum(sizes), 0, []
    for size in sizes:
        if fraction <= 0 or off >= fraction * total - 1e-9:
            homes.append(Tier.DEVICE)
            continue
        off += size
        if host_left[0] >= size:
            host_left[0] -= size
            homes.append(Tier.HOST)
        else:
            homes.append(Tier.DISK)
    return homes


class Trace:
    """The order payloads are touched in one step, to answer "when is this used next?"."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = list(keys)
        self._at: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(self.keys):
            self._at[key].append(i)

    def next_use(self, key: str, now: int) -> float:
        """Touches from ``now`` until ``key`` is touched again (wrapping into the next step);
        infinity for a key the step never touches."""
        at = self._at.get(key)
        if not at:
            return float("inf")
        i = bisect.bisect_right(at, now)
        return at[i] - now if i < len(at) else at[0] + len(self.keys) - now


class Placer:
    """Budgets, homes and eviction over a ``TierStore`` (see the module docstring)."""

    def __init__(self, store: TierStore, mode: str, device_budget: int | None,
                 host_budget: int | None, predicted: Trace) -> None:
        self.store, self.mode = store, mode
        self.budget = {Tier.DEVICE: device_budget, Tier.HOST: host_budget, Tier.DISK: None}
        self._reserve = 0  # device bytes that are not model state (activation_reserve.py)
        self.floor = {t: 0 for t in Tier}  # the least one step needs at once on each tier
        self.home: dict[str, Tier] = {}
        self.resident: dict[Tier, dict[str, Payload]] = {t: {} for t in Tier}
        self.trace = predicted
        self._recording: list[str] = []
        self.in_use: set[str] = set()
        self.before_spill: Callable[[Payload], None] | None = None  # a payload leaves for disk

    @property
    def reserve(self) -> int:
        return self._reserve

    @reserve.setter
    def reserve(self, nbytes: int) -> None:
        self._reserve = nbytes
        self.store.set_activations(nbytes)

    def plan_reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` for activations to come and evict for them now."""
        self._reserve = nbytes
        self.store.activations = nbytes
        self.make_room(Tier.DEVICE, 0)

    # ---- bookkeeping ---------------------------------------------------------------------
    def register(self, payload: Payload) -> None:
        self.resident[payload.tier][payload.key] = payload
        self.home.setdefault(payload.key, payload.tier)

    def forget(self, payload: Payload) -> None:
        self.resident[payload.tier].pop(payload.key, None)

    def touch(self, key: str) -> None:
        self._recording.append(key)

    def end_step(self) -> None:
        """The step just traced predicts the next one."""
        if self._recording:
            self.trace = Trace(self._recording)
        self._recording = []

    @property
    def now(self) -> int:
        return len(self._recording)

    def limit(self, tier: Tier) -> float:
        """What may be resident on ``tier``. Static placement decided its homes by the budgets
        already; the chunk it is working on is over them, so only ``auto`` enforces them."""
        budget = self.budget[tier]
        if budget is None or self.mode == "static":
            return float("inf")
        return budget - (self.reserve if tier == Tier.DEVICE else 0)

    # ---- movement ------------------------------------------------------------------------
    def bring(self, payload: Payload, tier: Tier, *, reads_only: bool = False,
              overwrites: bool = False) -> None:
        """Make ``payload`` resident on ``tier`` (device or host), evicting others for room.
        The caller changes its values unless it ``reads_only`` (then a file holding them stays
        a copy, and evicting it again writes nothing); ``overwrites``: it sets every value, so
        none is read from disk."""
        if not reads_only:
            self.store.modified(payload)
        if payload.tier == tier:
            return
        if payload.tier > tier:
            self.make_room(tier, payload.nbytes, keep={payload.key})
        self._move(payload, tier, fill=not overwrites)

    def settle(self, payload: Payload) -> None:
        """After a use: a static payload goes back to its home tier."""
        if self.mode == "static" and payload.tier != self.home[payload.key]:
            home = self.home[payload.key]
            if home != Tier.DISK:
                self.make_room(home, payload.nbytes, keep={payload.key})
            self._move(payload, home)

    def make_room(self, tier: Tier, nbytes: int, keep: set[str] = frozenset()) -> None:
        """Evict payloads of ``tier`` (furthest next use first) until ``nbytes`` more fit."""
        limit = self.limit(tier)
        if self.store.used[tier] + nbytes <= limit:
            return
        if tier == Tier.DEVICE and self.store.spare_bytes:
            self.store.drop_spares()  # recycled buffers use only room nobody needs
            if self.store.used[tier] + nbytes <= limit:
                return
        now = self.now
        victims = sorted((p for k, p in self.resident[tier].items()
                          if k not in keep and k not in self.in_use),
                         key=lambda p: self.trace.next_use(p.key, now), reverse=True)
        for victim in victims:
            if self.store.used[tier] + nbytes <= limit:
                return
            lower = Tier(tier + 1)
            if lower != Tier.DISK:
                self.make_room(lower, victim.nbytes, keep=keep)
            self._move(victim, lower)
        if tier == Tier.DEVICE and self.store.used[tier] + nbytes > limit:
            self.store.cancel_uploads()  # prefetched copies give way to what is needed now
        if self.store.used[tier] + nbytes > limit:
            reserve = self.reserve if tier == Tier.DEVICE else 0
            measured = (f" and {human_bytes(reserve)} of activations measured in this step"
                        if reserve else "")
            need = max(self.store.used[tier] + nbytes, self.floor[tier]) + reserve
            raise BudgetError(
                f"the {tier.label} budget of {human_bytes(self.budget[tier])} per rank cannot "
                f"hold what this step needs at once: {human_bytes(self.store.used[tier])} in "
                f"use that cannot move, {human_bytes(nbytes)} more{measured}; give at least "
                f"{human_bytes(need)} ({tier.label}_mem=...) or use a smaller micro-batch")

    def prefetch_to_device(self, payload: Payload) -> None:
        """Start moving a host payload to the device ahead of its use (the next unit's
        parameters; a GPU's side stream) if the device budget has room for it now."""
        if payload.tier == Tier.HOST and (self.store.used[Tier.DEVICE] + payload.nbytes
                                          <= self.limit(Tier.DEVICE)):
            self.store.prefetch_to_device(payload)

    def prefetch(self, payload: Payload) -> None:
        """Start reading a disk payload back if the host budget has room for it now."""
        if payload.tier == Tier.DISK and (self.store.used[Tier.HOST] + payload.nbytes
                                          <= self.limit(Tier.HOST)):
            self.store.prefetch(payload)

    def check_budgets(self) -> None:
        """Before the first step: each budget holds the least one step needs (the largest
        unit gathered with its gradient buffer on the device; one chunk's gradient, master
        and states on the host), or a ``BudgetError`` states that minimum per tier."""
        short = [f"{t.label}_mem={human_bytes(self.budget[t])} < {human_bytes(self.floor[t])}"
                 for t in (Tier.DEVICE, Tier.HOST)
                 if self.mode == "auto" and self.floor[t] > self.limit(t)]
        if short:
            raise BudgetError(
                "the per-rank budgets cannot hold what one step needs at once ("
                + "; ".join(short) + "): raise them to at least the minimum, or use smaller "
                "blocks (more layers of smaller width split into more units)")

    def enforce(self) -> None:
        """Evict until every tier is within its budget (after payloads appeared in place)."""
        self.make_room(Tier.DEVICE, 0)
        self.make_room(Tier.HOST, 0)

    def place(self, payload: Payload, tier: Tier) -> None:
        """Move without budget checks (initial homes)."""
        self._move(payload, tier)

    def _move(self, payload: Payload, tier: Tier, fill: bool = True) -> None:
        if tier == Tier.DISK and self.before_spill is not None:
            self.before_spill(payload)
        self.resident[payload.tier].pop(payload.key, None)
        self.store.move(payload, tier, fill)
        self.resident[tier][payload.key] = payload
