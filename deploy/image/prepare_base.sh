#!/usr/bin/env bash
# Make a plain Python base image look like the parts of Jupyter's docker-stacks the Dockerfile
# relies on; on a docker-stacks base (start-notebook.py present) it does nothing.
#
# Why it exists: the Dockerfile takes its base as a build argument. docker-stacks' images are the
# default, but where no registry is reachable (tests/deploy/test_image_build.py) the base is a
# Debian made locally with debootstrap: python3 and python3-venv, nothing else. There this adds
#   - the user jovyan (NB_UID 1000, group users = NB_GID 100) with its home,
#   - a virtualenv at /opt/venv owned by jovyan (Debian's Python refuses pip installs into
#     itself, PEP 668), first on PATH (the Dockerfile's ENV),
#   - /usr/local/bin/before-notebook.d/ and a start-notebook.py that sources its hooks, then
#     runs JupyterLab on port 8888, as docker-stacks' does.
# Runs as root, with the Dockerfile's NB_USER, NB_UID, NB_GID in the environment.
set -euo pipefail

if command -v start-notebook.py >/dev/null; then
    echo "prepare_base: a docker-stacks base, nothing to add"
    exit 0
fi
for tool in python3 useradd; do
    command -v "${tool}" >/dev/null || {
        echo "prepare_base: the base image has no ${tool}; use a docker-stacks base or one" \
             "with python3 and python3-venv (e.g. debootstrap --include=python3,python3-venv)" >&2
        exit 1
    }
done

getent group "${NB_GID}" >/dev/null || groupadd --gid "${NB_GID}" users
id "${NB_USER}" >/dev/null 2>&1 || \
    useradd --create-home --shell /bin/bash --uid "${NB_UID}" --gid "${NB_GID}" "${NB_USER}"
python3 -m venv /opt/venv
chown -R "${NB_UID}:${NB_GID}" /opt/venv
mkdir -p /usr/local/bin/before-notebook.d

cat >/usr/local/bin/start-notebook.py <<'PY'
#!/bin/bash
# docker-stacks' start-notebook.py, reduced: the before-notebook.d hooks, then JupyterLab.
for hook in /usr/local/bin/before-notebook.d/*.sh; do
    [[ -f "${hook}" ]] && source "${hook}"
done
exec jupyter lab --ip=0.0.0.0 --port="${JUPYTER_PORT:-8888}" --no-browser "$@"
PY
chmod 0755 /usr/local/bin/start-notebook.py
echo "prepare_base: added ${NB_USER} (${NB_UID}:${NB_GID}), /opt/venv ($(python3 --version))"
