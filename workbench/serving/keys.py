"""API keys of serving endpoints: generated, kept in a 0600 file in Jupyter's runtime folder,
read back on request (``api_key()``), never printed: saved notebooks keep their outputs."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def key_file(port: int) -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / f"workbench-serve-{port}.key"


def new_key(port: int, key: str | None = None) -> tuple[str, Path]:
    """Write ``key`` (a generated one by default) to the endpoint's key file, mode 0600."""
    key = key or f"wb-{secrets.token_urlsafe(24)}"
    path = key_file(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key, path


def api_key(port: int | None = None) -> str:
    """The key of the endpoint on ``port`` (of the only running one by default), for a client:
    ``OpenAI(base_url=..., api_key=workbench.serving.api_key())``."""
    if port is None:
        from workbench.serving.server import running_servers

        servers = running_servers()
        if len(servers) != 1:
            raise LookupError(f"{len(servers)} endpoints are running here; pass the port")
        port = servers[0].port
    path = key_file(port)
    if not path.exists():
        raise LookupError(f"no API key for port {port} ({path}): the endpoint runs without a "
                          "key, or is not running")
    return path.read_text()
