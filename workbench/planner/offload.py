"""Offload terms: model state on device, host and disk, the bytes moved between them per step,
and what moving them costs (``offload=static|auto``, the runtime's ``kernels_runtime.memory``).

The model's chunks, as the runtime packs them, are rebuilt in ``offload_chunks.py``.

Per chunk of p (padded) parameters, bytes per rank (``chunk_sync.py``'s table), e the compute
dtype's bytes:

| payload | zero 2 | zero 3 |
|---|---|---|
| param | e.p (whole) | e.p/N (shard) |
| master | 4p/N (none in fp32 at N=1 under auto) | 4p/N, none in fp32 (the param shard is it) |
| grad | 4p/N | 4p/N |
| states (AdamW m, v) | 8p/N | 8p/N |

Placement (``placement.py``). Static: parameters, then gradients, then masters take the host
budget in that order (``host_mem``, unlimited if unset), the rest of what leaves the device goes
to disk; optimizer states follow their master. Auto (Belady eviction under ``device_mem``) is
modelled as the static rule with one fraction f for every kind, the least that keeps model
state and the working set under ``device_mem`` (the runtime's device account: activations are
not in it); the host holds at most ``host_mem`` of what leaves, the rest is on disk.

Device peak = state homed on the device + the working set: the largest unit gathered whole on
the device (what is not there already) with its fp32 gradient buffer (the runtime's own
``floor``) + activations. Gradients peak at the end of backward, when every chunk has one. At
one data rank the reduced buffer itself becomes the gradient shard (nothing in passage).

Bytes moved per step (every micro-batch's forward and backward; ``tiers.TierStore.moved``):
an off-device parameter chunk travels to the device before each forward use (a tied embedding
twice: the embedding and the head) and once before its backward (then held), and back home after
each; a gradient goes to its home after the first micro-batch's backward and comes back and
returns for each later one; at the step a gradient, master and states not already where the
master steps (the device if the master's home is the device, else the host) are brought there;
disk-homed ones are read once and written back once; publishing the updated master to a whole
(zero 2) parameter brings an off-device parameter to the device and back. A disk file outlives
its read-back while the values are unchanged (``memory/disk_traffic.py``): a disk-homed
parameter is read for each use but written once per step (after the publish, which reads
nothing: it overwrites); under static placement a chunk whose step needs the disk is stepped
right before its next forward (``memory/deferred_step.py``), which then uses the published
parameters without reading them.

Time. Parameter and gradient moves in forward and backward are exposed: the runtime fetches a
unit in its forward pre-hook and waits for it (no prefetch during forward/backward), one copy
at a time. The host optimizer step (28 bytes of host memory traffic per element,
``HOST_ADAM_BYTES_PER_ELEMENT``) overlaps the disk: the next chunk's reads are started before
this one steps and writes are write-behind, so the step costs the larger of the two, plus its
PCIe copies.
"""

from __future__ import annotations

import math
from functools import cached_property

from kernels_runtime.byte_sizes import human_bytes
from kernels_runtime.mesh.plan import PlanError
from workbench.planner.offload_chunks import CATEGORY, KINDS, chunk_list, static_homes, unit_params
from workbench.planner.setting import TIERS, MemoryItem, Setting, TimeItem


class Layout:
    """Chunks, payload bytes and homes of one offload plan on one rank."""

    def __init__(self, st: Setting, fractions: dict[str, float] | None = None) -> None:
        self.st = st
        plan, n = st.plan, st.data_ranks
        self.chunks = chunk_list(st)
        # ``ChunkGradSync._param_is_master``: one payload when the param is the fp32 shard
        self.aliased = plan.precision == "fp32" and (
            plan.zero_stage == 3 or (n == 1 and plan.offload == "auto"))
        e = st.elem
        param_div = n if plan.zero_stage == 3 else 1
        self.bytes = {"param": [e * c.padded / param_div for c in self.chunks],
                      "grad": [4 * c.padded / n for c in self.chunks],
                      "master": [0.0 if self.aliased else 4 * c.padded / n
                                 for c in self.chunks],
                      "state": [8 * c.padded / n for c in self.chunks]}
        if fractions is None:
            fractions = {"params": plan.offload_params, "grads": plan.offload_grads,
                         "optim": plan.offload_optim}
        self.fractions = fractions
        host = [math.inf if plan.host_mem is None else float(plan.host_mem)]
        share = max(fractions["params"], fractions["optim"]) if self.aliased \
            else fractions["params"]
        self.home = {"param": static_homes(self.bytes["param"], share, host),
                     "grad": static_homes(self.bytes["grad"], fractions["grads"], host)}
        self.home["master"] = self.home["param"] if self.aliased else \
            static_homes(self.bytes["master"], fractions["optim"], host)
        if plan.offload == "auto":  # the host budget also holds the states that leave
            self.home["state"] = static_homes(self.bytes["state"], fractions["optim"], host)
        else:  # static: states are created where their master lives
            self.home["state"] = list(self.home["master"])

    # ---- memory --------------------------------------------------------------------------
    def state_bytes(self, kind: str, tier: str) -> float:
        return sum(b for b, h in zip(self.bytes[kind], self.home[kind]) if h == tier)

    @cached_property
    def by_unit(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, c in enumerate(self.chunks):
            out.setdefault(c.unit, []).append(i)
        return out

    @cached_property
    def working_set(self) -> float:
        """Device bytes one unit's backward adds to what is homed there (measured against the
        runtime): the unit gathered whole (zero 3 over N > 1 ranks: an all-gather buffer, plus
        the shard brought over if it is homed elsewhere; else the whole parameter if it is off
        the device), its fp32 gradient buffer, a gradient shard in passage to an off-device
        home, the unit before it (gathered again for its own backward once this unit's input
        gradient exists, while this one still waits for its weight gradients) and, from the
        third unit on, a tied token embedding (unit 0), which stays gathered through the whole
        backward since its gradient completes only at the embedding lookup's backward."""
        st, out = self.st, 0.0
        gathered_of: list[float] = []
        for _, ids in sorted(self.by_unit.items()):
            gathered = 0.0
            for i in ids:
                whole = st.elem * self.chunks[i].padded
                away = self.home["param"][i] != "device"
                if st.plan.zero_stage == 3 and st.data_ranks > 1:
                    gathered += whole + (self.bytes["param"][i] if away else 0.0)
                elif away:
                    gathered += whole
            passing = max((self.bytes["grad"][i] for i in ids
                           if self.home["grad"][i] != "device"), default=0.0) \
                if st.data_ranks > 1 else 0.0  # at N=1 the buffer becomes the gradient
            grad_buffer = 4 * sum(self.chunks[i].padded for i in ids)
            before = gathered_of[-1] if gathered_of else 0.0
            held = gathered_of[0] if len(gathered_of) >= 2 and st.spec.tied_embeddings else 0.0
            gathered_of.append(gathered)
            out = max(out, gathered + grad_buffer + passing + before + held)
        return out

    @property
    def floor(self) -> float:
        """The runtime's device floor (``ChunkGradSync``): max over units of (e + 4) bytes per
        padded parameter."""
        return max(sum(self.chunks[i].padded for i in ids) * (self.st.elem + 4)
                   for ids in self.by_unit.values())

    def device_need(self) -> float:
        """Device bytes of model state at its peak plus the working set."""
        return sum(self.state_bytes(k, "device") for k in KINDS) + self.working_set

    def items(self) -> list[MemoryItem]:
        """Model state per tier and category (gradients at their end-of-backward peak), and the
        working set on the device."""
        out = []
        for tier in TIERS:
            for kind in KINDS:
                b = self.state_bytes(kind, tier)
                if b:
                    out.append(MemoryItem(CATEGORY[kind], b, tier=tier, note=f"{kind} chunks"))
        out.append(MemoryItem("buffers", self.working_set,
                              note="working set: largest unit gathered + gradient buffer"))
        return out

    # ---- movement ------------------------------------------------------------------------
    @cached_property
    def moved(self) -> dict[tuple[str, str], float]:
        """Bytes moved per step, keyed (from tier, to tier) as ``TierStore.moved``."""
        out: dict[tuple[str, str], float] = {}

        def hop(a: str, b: str, nbytes: float, times: float = 1) -> None:
            if a != b and nbytes and times:
                out[(a, b)] = out.get((a, b), 0.0) + nbytes * times

        st, m = self.st, self.st.microbatches
        uses = unit_params(st)[1]
        for i, c in enumerate(self.chunks):
            home, nb = self.home["param"][i], self.bytes["param"][i]
            fetches = m * (uses.count(c.unit) + 1)  # each forward use, and once for backward
            publishes = not self.aliased
            if home == "disk":  # read per use, written once (the publish changed it)
                hop(home, "device", nb, fetches - (1 if self.deferred(i) else 0))
                hop("device", home, nb, 1 if publishes else 0)
            else:
                hop(home, "device", nb, fetches)
                hop("device", home, nb, fetches)
            g_home, g = self.home["grad"][i], self.bytes["grad"][i]
            hop("device", g_home, g, m)  # after each backward's reduction
            hop(g_home, "device", g, m - 1)  # brought back to add the next micro-batch's
            where = "device" if self.home["master"][i] == "device" else "host"
            hop(g_home, where, g)  # to the optimizer step
            for kind in ("master", "state"):
                k_home, kb = self.home[kind][i], self.bytes[kind][i]
                hop(k_home, where, kb)
                hop(where, k_home, kb)
            if self.aliased or home == "disk":  # nothing to publish, or overwritten unread
                continue
            if st.plan.zero_stage == 2 or st.data_ranks == 1:  # publish to a whole parameter
                hop(home, "device", nb)
                hop("device", home, nb)
            else:
                target = "device" if self.home["master"][i] == "device" else "host"
                hop(home, target, nb)
                hop(target, home, nb)
        return out

    def deferred(self, i: int) -> bool:
        """Whether chunk ``i``'s step waits for its next forward (static, disk in its step)."""
        return self.st.plan.offload == "static" and "disk" in (
            self.home["grad"][i], self.home["master"][i], self.home["state"][i])

    def link_bytes(self, phase: str | None = None) -> dict[str, float]:
        """PCIe (host<->device, including disk<->device copies through host memory), disk read
        and disk write bytes per step."""
        moved = self.moved if phase is None else self._phase(phase)
        pcie = sum(v for (a, b), v in moved.items() if "device" in (a, b))
        return {"pcie": pcie, "disk_read": sum(v for (a, _), v in moved.items() if a == "disk"),
                "disk_write": sum(v for (_, b), v in moved.items() if b == "disk")}

    def _phase(self, phase: str) -> dict[tuple[str, str], float]:
        """Forward + backward (parameters and gradient homes) or the step (the rest)."""
        m = self.st.microbatches
        uses = unit_params(self.st)[1]
        out: dict[tuple[str, str], float] = {}
        for i, c in enumerate(self.chunks):
            home, nb = self.home["param"][i], self.bytes["param"][i]
            g_home, g = self.home["grad"][i], self.bytes["grad"][i]
            if home != "device":
                fetches = m * (uses.count(c.unit) + 1)
                if home == "disk" and self.deferred(i):
                    fetches -= 1  # the deferred step's publish feeds the first forward
                out[(home, "device")] = out.get((home, "device"), 0.0) + nb * fetches
                if home != "disk":  # a disk file is rewritten only after the step
                    out[("device", home)] = out.get(("device", home), 0.0) + nb * fetches
            if g_home != "device":
                out[("device", g_home)] = out.get(("device", g_home), 0.0) + g * m
                out[(g_home, "device")] = out.get((g_home, "device"), 0.0) + g * (m - 1)
        if phase == "train":
            return out
        return {k: v - out.get(k, 0.0) for k, v in self.moved.items() if v - out.get(k, 0.0)}

    @property
    def host_elements(self) -> float:
        """Optimizer-updated elements whose step runs on the host (master homed off device)."""
        return sum(b / 4 for b, h in zip(self.bytes["grad"], self.home["master"])
                   if h != "device")

    @property
    def device_elements(self) -> float:
        return sum(b / 4 for b, h in zip(self.bytes["grad"], self.home["master"])
                   if h == "device")


# ---- the terms cost_model calls ------------------------------------------------------------
def layout(st: Setting) -> Layout:
    """The plan's layout: its static fractions, or under auto the least uniform fraction that
    fits ``device_mem`` (``auto_fraction``). Built once per setting and kept in the setting's
    ``__dict__`` (as ``functools.cached_property`` would): the memory and time terms both read
    it, and ``offload=auto`` searches for its fraction. It lives here, not as a property of
    ``Setting``, so that ``setting.py`` need not import this module, which imports it."""
    cached = st.__dict__.get("_offload_layout")
    if cached is None:
        if st.plan.offload == "auto":
            f = auto_fraction(st)
            cached = Layout(st, {"params": f, "grads": f, "optim": f})
        else:
            cached = Layout(st)
        st.__dict__["_offload_layout"] = cached  # a frozen dataclass still has a __dict__
    return cached


def auto_fraction(st: Setting) -> float:
    """The least f in steps of 1/64 for which model state on the device + the working set stay
    under ``device_mem`` (the profile's device memory if unset), by bisection (the device need
    falls as f grows). The budget is the runtime's device account, which holds model state and
    its working buffers, not activations (its placer reserves nothing for them today). A budget
    under the runtime's floor (the largest unit's parameters gathered with its fp32 gradient
    buffer) is its BudgetError, raised here as PlanError with the minimum."""
    budget = st.plan.device_mem if st.plan.device_mem is not None else st.hw.device_memory
    floor = Layout(st, dict.fromkeys(("params", "grads", "optim"), 1.0)).floor
    if floor > budget:
        raise PlanError(
            f"device_mem={human_bytes(budget)} per rank is below what one step needs on the "
            f"device at once, {human_bytes(floor)} (the largest unit gathered with its gradient "
            f"buffer); give at least device_mem={human_bytes(floor)}, or use more, smaller "
            "blocks")

    def fits(k: int) -> bool:
        lay = Layout(st, dict.fromkeys(("params", "grads", "optim"), k / 64))
        return lay.device_need() <= budget

    if fits(0):
        return 0.0
    lo, hi = 0, 64  # fits(hi), or nothing does and the runtime evicts down to its floor
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi / 64


def model_states(st: Setting) -> list[MemoryItem]:
    """Replaces ``memory.model_states`` and ``memory.buffers`` under offload."""
    return layout(st).items()


def check_rates(st: Setting, lay: Layout) -> None:
    """A plan whose moves need a rate the profile does not know is refused, not priced at 0."""
    links = lay.link_bytes()
    need = [("pcie_bandwidth", links["pcie"] > 0), ("host_bandwidth", lay.host_elements > 0),
            ("disk_read", links["disk_read"] > 0), ("disk_write", links["disk_write"] > 0)]
    missing = [name for name, used in need if used and not getattr(st.hw, name)]
    if missing:
        raise PlanError(f"offload={st.plan.offload} moves model state over links {st.hw.name} "
                        f"has no rate for ({', '.join(missing)}); calibrate the profile "
                        "(workbench.planner.calibrate) or give the rates")


def transfer_seconds(st: Setting, links: dict[str, float]) -> float:
    hw = st.hw
    out = links["pcie"] / hw.pcie_bandwidth if links["pcie"] else 0.0
    out += links["disk_read"] / hw.disk_read if links["disk_read"] else 0.0
    return out + (links["disk_write"] / hw.disk_write if links["disk_write"] else 0.0)


def offload_time(st: Setting) -> list[TimeItem]:
    """Exposed movement in forward and backward, and the step's movement and host Adam: see the
    module docstring for what overlaps."""
    lay = layout(st)
    check_rates(st, lay)
    train, step = lay.link_bytes("train"), lay.link_bytes("step")
    host_adam = lay.host_elements / st.hw.host_adam_rate if lay.host_elements else 0.0
    disk = transfer_seconds(st, {**step, "pcie": 0.0})
    pcie = transfer_seconds(st, {"pcie": step["pcie"], "disk_read": 0, "disk_write": 0})
    return [
        TimeItem("offload: parameter and gradient moves", "offload",
                 transfer_seconds(st, train), phase="backward", nbytes=sum(train.values()),
                 note="exposed: fetched on demand in each unit's hooks"),
        TimeItem("offload: host Adam || disk streaming", "offload", max(host_adam, disk) + pcie,
                 phase="step", nbytes=sum(step.values()),
                 note=f"host Adam {host_adam:.3g} s, disk {disk:.3g} s overlapped; PCIe "
                      f"{pcie:.3g} s"),
    ]


def device_optimizer(st: Setting) -> list[TimeItem]:
    """Replaces ``timing.optimizer`` under offload: Adam on device-homed masters only."""
    elems = layout(st).device_elements
    return [TimeItem("optimizer step", "optimizer", elems / st.hw.adam_rate
                     + (4 * elems if st.elem != 4 else 0.0)
                     / st.hw.elementwise_bandwidth["fp32"])]
