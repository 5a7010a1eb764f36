"""Which user's server holds which GPUs, on a hub that runs every server on one machine.

Why it exists: without Kubernetes nothing schedules GPUs. The single-server hub
(``jupyterhub_config.py``) gives each server the devices its profile asks for, as
``CUDA_VISIBLE_DEVICES``, from one pool owned by the hub process; a request the free devices
cannot meet is refused with a message saying who holds what, and a stopped server's devices
return to the pool. Kept free of JupyterHub imports, so its rules are unit-tested alone
(tests/deploy/test_device_pool.py) and the spawner stays a thin adapter.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class DevicesBusy(RuntimeError):
    """Too few devices are free for a request; the message says who holds them."""


class DevicePool:
    """Devices (``CUDA_VISIBLE_DEVICES`` entries, e.g. ``"0"`` or a GPU UUID) handed out to
    owners (one owner per server, e.g. ``"alice"`` or ``"alice/big"``)."""

    def __init__(self, devices: Iterable[str]) -> None:
        self.devices = [str(d).strip() for d in devices]
        if any(not d or "," in d for d in self.devices):
            raise ValueError(f"devices {self.devices!r}: give one non-empty name per device, "
                             "e.g. ['0', '1'], as CUDA_VISIBLE_DEVICES names them")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"devices {self.devices!r}: each device may be listed only once")
        self._owner: dict[str, str] = {}  # device -> owner

    def held(self, owner: str) -> list[str]:
        """The devices ``owner`` holds, in the pool's order."""
        return [d for d in self.devices if self._owner.get(d) == owner]

    def free(self) -> list[str]:
        return [d for d in self.devices if d not in self._owner]

    def acquire(self, owner: str, count: int) -> list[str]:
        """``count`` free devices for ``owner`` (its earlier ones first: a server that restarts
        keeps its devices). Raises ``ValueError`` when the machine has fewer than ``count``
        devices at all and ``DevicesBusy`` when too few are free now."""
        if count < 0:
            raise ValueError(f"count={count}: ask for 0 or more devices")
        if count > len(self.devices):
            raise ValueError(
                f"this profile needs {count} GPUs but this server has {len(self.devices)}; "
                "choose a smaller profile")
        mine = self.held(owner)
        if len(mine) >= count:
            chosen = mine[:count]
        else:
            others = self.free()
            if len(mine) + len(others) < count:
                raise DevicesBusy(self._busy_message(owner, count))
            chosen = mine + others[: count - len(mine)]
        self.release(owner)
        for d in chosen:
            self._owner[d] = owner
        return chosen

    def claim(self, owner: str, devices: Iterable[str]) -> None:
        """Mark ``devices`` as ``owner``'s again (a hub that restarted while servers ran).
        Devices the pool no longer lists are ignored; one held by another owner is an error."""
        for d in devices:
            holder = self._owner.get(d)
            if holder not in (None, owner):
                raise DevicesBusy(f"device {d} is recorded for both {holder} and {owner}")
            if d in self.devices:
                self._owner[d] = owner

    def release(self, owner: str) -> list[str]:
        """Return ``owner``'s devices to the pool; the list of those released."""
        mine = self.held(owner)
        for d in mine:
            del self._owner[d]
        return mine

    def _busy_message(self, owner: str, count: int) -> str:
        holders: dict[str, list[str]] = {}
        for d in self.devices:
            if d in self._owner and self._owner[d] != owner:
                holders.setdefault(self._owner[d], []).append(d)
        held = "; ".join(f"{o}: {','.join(ds)}" for o, ds in sorted(holders.items()))
        free = len(self.free()) + len(self.held(owner))
        return (f"All GPUs of this server are taken: this profile needs {count}, {free} "
                f"{'is' if free == 1 else 'are'} free (in use by {held}). Try again when a "
                "server stops (idle ones are stopped automatically), or choose the CPU profile.")


def detect_devices(environ: dict[str, str] | None = None) -> list[str]:
    """The hub machine's GPUs: ``$WORKBENCH_HUB_DEVICES`` (comma-separated) if set, else
    the hub's own ``CUDA_VISIBLE_DEVICES``, else one per NVIDIA driver entry (read without
    importing torch, which the hub's environment need not have)."""
    env = os.environ if environ is None else environ
    for key in ("WORKBENCH_HUB_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = env.get(key)
        if value is not None:
            return [d.strip() for d in value.split(",") if d.strip() not in ("", "-1")]
    nvidia = "/proc/driver/nvidia/gpus"
    return [str(i) for i in range(len(os.listdir(nvidia)))] if os.path.isdir(nvidia) else []
