"""The playground image built for real from the repository's Dockerfile, its test stage included:
`make test-image` (marker ``image``; .ci/run installs podman and debootstrap and runs it).

What is protected: the Dockerfile builds (base image as a build argument, the install through
binder/install.sh, the lab extension compiled inside), and its ``test`` stage executes the
quickstart notebook with nbclient inside the image and checks its outputs; the default target is
tagged only after that stage passed, and carries its verdict file, which the test reads back
from the image. A failure names the step that failed (the base, the install, or the quickstart
and its failing cell).

How it builds here, where no Docker engine runs, no container can run and no registry is
reachable (docs/deploy/jupyterhub.md, "Building the image"):
- Debian's podman, ``podman build --format docker --isolation chroot --network host``: RUN
  steps run chrooted, pip reaches PyPI; ``--format docker`` keeps the Dockerfile's bash SHELL
  (OCI images drop it). A containers.conf with ``default_ulimits = []`` (a refused setrlimit).
- The base: ``debootstrap --variant=minbase`` of Debian bookworm with python3 and python3-venv
  (Python 3.11), imported as ``localhost/workbench-base:bookworm``; its tarball is cached under
  ``$WORKBENCH_CACHE_DIR/image/`` (else ~/.cache/colossal-workbench/image/), so a rerun on a
  machine whose podman storage was wiped skips debootstrap.
- torch from a local CPU wheel (``TORCH_WHEELS``; found through WORKBENCH_TORCH_WHEELS, else
  pip's find-links), so the build does not download PyPI's multi-GB CUDA torch.
- The lab extension `make` built on the host (``LABEXTENSION``, mounted read-only), so the
  install does not compile it again with npm (minutes on 2 cores); the default build, for users,
  still compiles it. Its compilation from a clean checkout is `make`'s and test-install's.
podman's layer cache keeps the torch and requirements layer between runs: a rerun rebuilds the
workbench install and reruns the quickstart. The log (``last-build.log`` in the cache folder)
gives each step's seconds; the test removes its image and build containers when done, keeping
the base and the cached layers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kernels_runtime.user_cache import cache_root

pytestmark = [pytest.mark.image, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/workbench-base:bookworm"
TAG = "localhost/colossal-workbench:test"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
BASE_PYTHON_TAG = "cp311"  # bookworm's python3 is 3.11: the torch wheel must match it
VERDICT = "/tmp/workbench-quickstart-verdict.txt"  # the Dockerfile's last COPY
LABEXTENSION = ROOT / "workbench" / "ui" / "lab" / "labextension"  # built by `make`
STEP = re.compile(r"^(?:\[\d+/\d+\] )?STEP \d+/\d+: (.*)$")


def run(cmd: list[str], what: str, env: dict[str, str], timeout: float = 900,
        **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure, fail saying ``what`` failed, with the end of its output."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, **kw)
    if proc.returncode:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n"
                    f"{proc.stdout[-4000:]}")
    return proc


def podman_env(cache: Path) -> dict[str, str]:
    conf = cache / "containers.conf"
    conf.write_text("[containers]\n# no ulimits copied into RUN steps: this machine refuses "
                    "the setrlimit\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def require_tools() -> None:
    missing = [t for t in ("podman", "debootstrap") if not shutil.which(t)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: apt-get install -y podman debootstrap")
    if os.geteuid() != 0:
        pytest.fail("the image build runs debootstrap and podman's root storage: run as root")


def ensure_base(cache: Path, env: dict[str, str]) -> str:
    """``BASE`` in podman's storage: already there, else imported from the cached tarball,
    else made by debootstrap (~1 min) and cached. Says which."""
    if subprocess.run(["podman", "image", "exists", BASE], env=env).returncode == 0:
        return "in podman's storage"
    tarball = cache / "bookworm-minbase.tar"
    made = "from the cached tarball"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            rootfs = Path(tmp) / "rootfs"
            run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm",
                 str(rootfs)], "debootstrap of the base image (Debian bookworm)", env)
            partial = tarball.with_suffix(".partial")
            run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], "packing the base", env)
            partial.rename(tarball)
        made = "by debootstrap"
    run(["podman", "import", str(tarball), BASE], f"importing {tarball} as {BASE}", env)
    return made


def torch_wheels() -> Path | None:
    """A folder holding a torch wheel for the base's Python: WORKBENCH_TORCH_WHEELS, else one
    of pip's find-links (its environment variable or its config files)."""
    folders = [os.environ.get("WORKBENCH_TORCH_WHEELS", "")]
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            stdout=subprocess.PIPE, text=True).stdout
    folders += [v for k, v in re.findall(r"^(\S*find-links)='([^']*)'", config, re.M)]
    for folder in filter(None, folders):
        path = Path(folder.removeprefix("file://"))
        if path.is_dir() and any(path.glob(f"torch-*-{BASE_PYTHON_TAG}-*linux*.whl")):
            return path
    return None


def timed_build(cmd: list[str], env: dict[str, str], log: Path,
                timeout: float) -> tuple[int, str, list[tuple[float, str]]]:
    """Run the build, writing its output to ``log`` with each line's elapsed seconds, and
    return its exit status, its output, and (seconds, step) for every step, longest first."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    start = last = time.monotonic()
    lines, steps, current = [], [], "(before the first step)"
    try:
        with log.open("w") as out:
            for line in proc.stdout:
                now = time.monotonic()
                out.write(f"{now - start:7.1f}s {line}")
                lines.append(line)
                step = STEP.match(line)
                if step:
                    steps.append((now - last, current))
                    current, last = step.group(1)[:120], now
        rc = proc.wait()
    finally:
        timer.cancel()
    steps.append((time.monotonic() - last, current))
    steps.sort(reverse=True)
    with log.open("a") as out:
        out.write(f"exit {rc} after {time.monotonic() - start:.0f} s; slowest steps:\n"
                  + "".join(f"{t:7.1f}s {step}\n" for t, step in steps[:5]))
    return rc, "".join(lines), steps


def explain_build_failure(output: str) -> str:
    """What failed, in words: the quickstart in the test stage, or which build step."""
    failed = re.findall(r'^Error: building at STEP "(.*)": (.*)$', output, re.M)
    steps = re.findall(r"^(?:\[\d+/\d+\] )?STEP \d+/\d+: (.*)$", output, re.M)
    last = (f"{failed[-1][0][:300]} ({failed[-1][1]})" if failed
            else steps[-1][:300] if steps else "(before the first step)")
    if "QUICKSTART FAILED" in output:
        verdict = output[output.index("QUICKSTART FAILED"):]
        return ("the image built, but its test stage failed: the quickstart notebook, executed "
                f"with nbclient inside the image, did not pass:\n{verdict[:5000]}")
    return f"building the image failed at step: {last}\n--- build output ends ---\n" \
        + output[-5000:]


def test_the_dockerfile_builds_the_image_and_its_quickstart_passes_inside():
    require_tools()
    cache = cache_root() / "image"
    cache.mkdir(parents=True, exist_ok=True)
    env = podman_env(cache)
    base_from = ensure_base(cache, env)

    cmd = ["podman", "build", "--format", "docker", "--isolation", "chroot", "--force-rm",
           "--network", "host", "-v", "/etc/ssl/certs:/etc/ssl/certs:ro",
           "--build-arg", f"BASE_IMAGE={BASE}", "-t", TAG]
    wheels = torch_wheels()
    if wheels is not None:
        cmd += ["-v", f"{wheels}:/wheels:ro", "--build-arg", "TORCH_WHEELS=/wheels"]
    extension = "compiled inside"
    if (LABEXTENSION / "static" / "style.js").is_file():
        cmd += ["-v", f"{LABEXTENSION}:/labextension:ro", "--build-arg",
                "LABEXTENSION=/labextension"]
        extension = "built by make"
    node_ca = os.environ.get("NODE_EXTRA_CA_CERTS")  # this machine's TLS-inspecting proxy
    if node_ca and Path(node_ca).is_file():
        if not node_ca.startswith("/etc/ssl/certs/"):  # that folder is mounted already
            cmd += ["-v", f"{node_ca}:{node_ca}:ro"]
        cmd += ["--build-arg", f"NODE_EXTRA_CA_CERTS={node_ca}"]
    log = cache / "last-build.log"
    started, rc = time.time(), 1
    try:
        rc, output, steps = timed_build([*cmd, str(ROOT)], env, log, timeout=1200)
        assert rc == 0, (f"podman build exited {rc} (-9: killed after 1200 s): "
                         f"{explain_build_failure(output)}\n(whole log, timed: {log})")

        # the tagged image holds the test stage's verdict: built after the quickstart passed
        mount = run(["podman", "image", "mount", TAG], "mounting the built image", env)
        try:
            verdict = (Path(mount.stdout.strip()) / VERDICT.lstrip("/")).read_text()
        finally:
            subprocess.run(["podman", "image", "unmount", TAG], env=env,
                           stdout=subprocess.DEVNULL)
        assert verdict.startswith("QUICKSTART PASSED: 00_quickstart.ipynb"), verdict
    finally:
        clean_up(env, started, built=rc == 0)
    cached = len(re.findall(r"^--> Using cache", output, re.M))
    print(f"image {TAG}: base {base_from}; torch from {wheels or 'the indexes'}; lab extension "
          f"{extension}; {cached} steps from podman's cache; {verdict.strip()}\n"
          "slowest steps: " + "; ".join(f"{t:.0f} s {step}" for t, step in steps[:4]))


def clean_up(env: dict[str, str], started: float, built: bool) -> None:
    """Free podman's storage (GBs a layer) of what a rerun does not reuse: working containers
    that builds killed before ``started`` left behind (each holds its layers), and, once this
    build succeeded, the images it replaced and its test stage (untagged now). The base, the
    tagged image and the cached layers below it (torch and the requirements) stay; after a
    failed build the new layers stay too, for the rerun."""
    listed = subprocess.run(["podman", "ps", "--all", "--external", "--format", "json"],
                            env=env, stdout=subprocess.PIPE, text=True).stdout
    stale = [c["Id"] for c in json.loads(listed or "[]")
             if c.get("State") == "storage" and c.get("Created", started) < started]
    if stale:
        subprocess.run(["podman", "rm", "--force", *stale], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if built:
        subprocess.run(["podman", "image", "prune", "--force"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
