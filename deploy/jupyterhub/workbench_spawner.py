"""A local-process spawner that gives each user's server its share of the machine's GPUs.

Why it exists: on one GPU server without Kubernetes, JupyterHub's ``LocalProcessSpawner``
starts every user's server as that user's Unix process, but nothing keeps two users off the
same GPU. ``DeviceShareSpawner`` adds what the chart's profiles do on Kubernetes: the user picks
a profile (``hub_profiles.py``, read from values.yaml), the server gets that many devices from the
hub's ``DevicePool`` as ``CUDA_VISIBLE_DEVICES`` (``""`` for the CPU profile: no GPU at all)
plus the profile's ``WORKBENCH_`` defaults, a request the free devices cannot meet is refused
with a message saying why, and stopping the server (by the user, an admin or the idle culler)
ends every process it started, the rank pool included, and returns its devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import sys
from pathlib import Path
from typing import Any

from device_pool import DevicePool, DevicesBusy, detect_devices
from hub_profiles import VALUES, Profile, find_profile, load_profiles
from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from tornado import web
from traitlets import List, Unicode, default

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

_pools: dict[tuple[str, ...], DevicePool] = {}  # one pool per device list, shared by spawners


class DeviceShareSpawner(LocalProcessSpawner):
    """``LocalProcessSpawner`` (each user's server runs as that Unix user) with profiles and a
    share of the GPUs."""

    devices = List(Unicode(), config=True, help="CUDA_VISIBLE_DEVICES names of the GPUs to "
                   "share out (default: $WORKBENCH_HUB_DEVICES, else every GPU of the machine)")
    values_file = Unicode(str(VALUES), config=True,
                          help="the values.yaml whose singleuser.profileList holds the profiles")
    notebooks_dir = Unicode(str(REPO / "notebooks"), config=True,
                            help="example notebooks copied into each home's notebooks/ folder "
                            "at every start (files the user already has are kept)")
    gpu_devices = List(Unicode())  # this server's share, kept in the hub's database (get_state)
    profile_slug = Unicode("")

    @default("devices")
    def _default_devices(self) -> list[str]:
        return detect_devices()

    @default("cmd")
    def _default_cmd(self) -> list[str]:
        # copies the example notebooks into the home, then becomes jupyterhub-singleuser
        return [sys.executable, str(HERE / "start_singleuser.py")]

    @default("default_url")
    def _default_url(self) -> str:
        return "/lab/tree/notebooks/00_quickstart.ipynb"

    @default("options_form")
    def _default_options_form(self) -> str:
        rows = []
        for p in self.profiles:
            checked = " checked" if p.default else ""
            rows.append(
                f'<label><input type="radio" name="profile" value="{html.escape(p.slug)}"'
                f'{checked}> <b>{html.escape(p.display_name)}</b> '
                f"{html.escape(p.description)}</label><br>")
        free = len(self.pool.free())
        rows.append(f"<p>{free} of {len(self.pool.devices)} GPUs of this server are free.</p>")
        return "\n".join(rows)

    @property
    def profiles(self) -> list[Profile]:
        return load_profiles(Path(self.values_file))

    @property
    def pool(self) -> DevicePool:
        key = tuple(self.devices)
        if key not in _pools:
            _pools[key] = DevicePool(key)
        return _pools[key]

    @property
    def owner(self) -> str:
        return f"{self.user.name}/{self.name}" if self.name else self.user.name

    def options_from_form(self, formdata: dict[str, list[str]]) -> dict[str, Any]:
        return {"profile": formdata.get("profile", [""])[0]}

    async def start(self) -> Any:
        try:
            profile = find_profile(self.profiles, self.user_options.get("profile"))
            self.gpu_devices = self.pool.acquire(self.owner, profile.gpus)
        except DevicesBusy as e:
            raise web.HTTPError(409, str(e)) from None  # polite: the hub shows the message
        except ValueError as e:
            raise web.HTTPError(400, str(e)) from None
        self.profile_slug = profile.slug
        self.log.info("%s: profile %s, devices [%s]", self.owner, profile.slug,
                      ",".join(self.gpu_devices))
        try:
            return await super().start()
        except BaseException:
            self._release()
            raise

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        profile = find_profile(self.profiles, self.profile_slug or None)
        env.update(profile.environment)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_devices)  # "": no GPU visible
        env["WORKBENCH_PROFILE"] = profile.slug
        env["WORKBENCH_NOTEBOOKS"] = self.notebooks_dir
        return env

    async def stop(self, now: bool = False) -> None:
        # The kernels, the ipyparallel controller and the ranks are descendants of the server;
        # whatever survives the server's own shutdown is ended here, so nothing keeps a GPU.
        import psutil

        try:
            tree = psutil.Process(self.pid).children(recursive=True) if self.pid else []
        except psutil.NoSuchProcess:
            tree = []
        try:
            await super().stop(now=now)
        finally:
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.terminate()
            # in a thread: waiting here blocked the hub's event loop for up to 5 s per stopped
            # server ("Event loop was unresponsive"), every other user's request with it
            _, alive = await asyncio.to_thread(psutil.wait_procs, tree, timeout=5)
            for proc in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            self._release()

    def _release(self) -> None:
        released = self.pool.release(self.owner)
        if released:
            self.log.info("%s: devices [%s] returned", self.owner, ",".join(released))
        self.gpu_devices = []

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.gpu_devices or self.profile_slug:
            state["gpu_devices"] = list(self.gpu_devices)
            state["profile"] = self.profile_slug
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if state.get("gpu_devices") is not None:  # the hub restarted while this server ran
            self.gpu_devices = state["gpu_devices"]
            self.profile_slug = state.get("profile", "")
            self.pool.claim(self.owner, self.gpu_devices)

    def clear_state(self) -> None:
        super().clear_state()
        self.gpu_devices = []
        self.profile_slug = ""


class SharedAccountDeviceSpawner(DeviceShareSpawner, SimpleLocalProcessSpawner):
    """Every server runs as the hub's own Unix user, each with its home under
    ``home_dir_template``. For tests and demos only: users are not isolated from each other
    at the file and process level (one can read another's connection files)."""
