"""JupyterHub on one GPU server, without Kubernetes: the colossal-workbench playground.

    sudo jupyterhub -f deploy/jupyterhub/jupyterhub_config.py

Each user logs in with their Unix account (PAM; members of the ``playground`` group), picks a
profile ("CPU (2 cores)", "1 GPU", "8 GPUs": the same as values.yaml's), and gets a JupyterLab
server running as their own Unix user with that many of the machine's GPUs as
``CUDA_VISIBLE_DEVICES`` (workbench_spawner.py, device_pool.py). A server idle for an hour is
stopped by jupyterhub-idle-culler, and its rank pool with it. docs/deploy/jupyterhub.md walks
through the setup.

Environment variables (all optional):
  WORKBENCH_HUB_DEVICES        GPUs to share out, e.g. "0,1,2,3" (default: all of the machine's)
  WORKBENCH_HUB_GROUP          the Unix group whose members may log in (default: playground)
  WORKBENCH_HUB_CULL_TIMEOUT   seconds idle before a server is stopped (default: 3600)
  WORKBENCH_HUB_CULL_EVERY     seconds between the culler's checks (default: 300)
  WORKBENCH_HUB_DUMMY_PASSWORD TESTS ONLY: any user name logs in with this password and every
                               server runs as the hub's own user, homes under
                               $WORKBENCH_HUB_HOMES (tests/playground/test_hub.py sets both)
"""

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # device_pool, hub_profiles, workbench_spawner

c = get_config()  # noqa: F821  (provided by JupyterHub when it reads this file)

dummy_password = os.environ.get("WORKBENCH_HUB_DUMMY_PASSWORD")
if dummy_password:
    # Tests only: no Unix accounts, no isolation between users' files.
    c.JupyterHub.authenticator_class = "dummy"
    c.DummyAuthenticator.password = dummy_password
    c.JupyterHub.spawner_class = "workbench_spawner.SharedAccountDeviceSpawner"
    homes = os.environ.get("WORKBENCH_HUB_HOMES", "/tmp/workbench-hub-homes")
    c.SharedAccountDeviceSpawner.home_dir_template = os.path.join(homes, "{username}")
    if os.geteuid() == 0:  # a CI container's root: the servers run as the hub's user
        c.Spawner.args = ["--allow-root"]
else:
    # A real team: Unix accounts through PAM, each server runs as its user (its files, its
    # processes and its pool's connection files are the user's own, mode 0600).
    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.allowed_groups = {os.environ.get("WORKBENCH_HUB_GROUP", "playground")}
    c.JupyterHub.spawner_class = "workbench_spawner.DeviceShareSpawner"

c.Spawner.start_timeout = 180  # a first start imports torch and builds the lab's page
c.Spawner.http_timeout = 120
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every server and its pool

# configurable-http-proxy from PATH, else where `make test-hub` installs it (npm, under .venv)
local_proxy = Path(sys.prefix) / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"
if not shutil.which("configurable-http-proxy") and local_proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(local_proxy)]

# Idle culling as a hub service: it stops servers idle for the timeout; the spawner's stop ends
# the server's kernels and their rank pools and returns the devices. Servers report their
# activity (a running cell counts) at least as often as the culler looks.
cull_timeout = int(os.environ.get("WORKBENCH_HUB_CULL_TIMEOUT", 3600))
cull_every = int(os.environ.get("WORKBENCH_HUB_CULL_EVERY", 300))
c.Spawner.environment = {"JUPYTERHUB_ACTIVITY_INTERVAL": str(min(300, cull_every))}
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [sys.executable, "-m", "jupyterhub_idle_culler",
                f"--timeout={cull_timeout}", f"--cull-every={cull_every}"],
}]
c.JupyterHub.load_roles = [{
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
}]
