# colossal-workbench playground image: JupyterLab with the workbench, its lab extension and the
# example notebooks, on a Jupyter docker-stacks base (user jovyan, port 8888, tini + start.sh).
#
#   docker build -t colossal-workbench .                       # CPU (2 gloo ranks)
#   docker run --rm -p 8888:8888 colossal-workbench             # open the printed 127.0.0.1 URL
#
# CUDA variant (one rank per GPU on nccl; needs the NVIDIA container toolkit):
#   docker build -t colossal-workbench:cuda12 \
#     --build-arg BASE_IMAGE=quay.io/jupyter/pytorch-notebook:cuda12-2026-08-03 .
#   docker run --rm --gpus all --shm-size 8g -p 8888:8888 colossal-workbench:cuda12
#
# Every build runs the quickstart notebook in the `test` stage (nbclient, two CPU ranks) and
# fails if a cell errs or its outputs are wrong, so an image that cannot run the examples is
# never tagged; `--target playground` builds the image without that check.
#
# Build arguments:
#   BASE_IMAGE    docker-stacks' pytorch-notebook by default (it brings torch). Any image with
#                 python3 and python3-venv works too (a plain Debian, as tests/deploy/
#                 test_image_build.py builds it): deploy/image/prepare_base.sh then adds the
#                 jovyan user, a virtualenv and a small start-notebook.py.
#   TORCH_WHEELS  a folder, inside the build, holding a torch wheel: torch is installed from it
#                 (--no-index) and requirements.txt's PyTorch CPU index is not asked, e.g. a local
#                 CPU build instead of PyPI's multi-GB CUDA one:
#                   podman build --format docker -v /opt/wheels:/wheels:ro \
#                     --build-arg TORCH_WHEELS=/wheels .
#                 or a folder of the build context (its wheel then also lands in the image's copy
#                 of the repository): --build-arg TORCH_WHEELS=wheels
#   NODE_EXTRA_CA_CERTS  build time only: Node.js's CA bundle behind a TLS-inspecting proxy.
#   LABEXTENSION  build time only: a folder, inside the build, holding the lab extension already
#                 built (workbench/ui/lab/labextension of a checkout after `make`): the install
#                 ships it instead of compiling extension/ with Node.js and npm (minutes), e.g.
#                   -v $PWD/workbench/ui/lab/labextension:/labextension:ro \
#                   --build-arg LABEXTENSION=/labextension
#                 Empty by default: the image compiles its extension from the sources it holds.
# podman needs --format docker: OCI images drop the SHELL below (RUN would use /bin/sh).
# The install itself is binder/install.sh, the same script Binder's postBuild runs and
# tests/playground/test_binder_install.py checks. docs/deploy/jupyterhub.md has the details.
ARG BASE_IMAGE=quay.io/jupyter/pytorch-notebook:2026-08-03
FROM ${BASE_IMAGE} AS playground

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# docker-stacks' user and paths; the same names on a plain base (prepare_base.sh makes them).
# /opt/venv/bin exists only on a plain base.
ENV NB_USER="${NB_USER:-jovyan}" NB_UID="${NB_UID:-1000}" NB_GID="${NB_GID:-100}" \
    PATH="/opt/venv/bin:${PATH}"
ENV WORKBENCH_HOME="/home/${NB_USER}/colossal-workbench" \
    PIP_NO_CACHE_DIR=1

USER root
COPY deploy/image/prepare_base.sh /usr/local/bin/workbench-prepare-base
RUN bash /usr/local/bin/workbench-prepare-base

# torch, the notebooks' libraries and the workbench's own dependencies (from pyproject.toml)
# first, in a layer of their own: a change to the rest of the repository rebuilds only the steps
# below it.
USER ${NB_UID}
ARG TORCH_WHEELS=""
COPY --chown=${NB_UID}:${NB_GID} binder/requirements.txt pyproject.toml \
    deploy/image/project_deps.py /tmp/workbench-deps/
RUN set -e; \
    cd /tmp/workbench-deps; \
    if [[ -n "${TORCH_WHEELS}" ]]; then \
        python -m pip install --no-deps --no-index --find-links "${TORCH_WHEELS}" torch || { \
            echo "TORCH_WHEELS=${TORCH_WHEELS}: no torch wheel there for this Python" >&2; exit 1; }; \
        sed -i '/^--extra-index-url/d' requirements.txt; \
    fi; \
    python project_deps.py pyproject.toml hf >project.txt; \
    python -m pip install -r requirements.txt -r project.txt

# Build time only (not kept in the image): a CA bundle for Node.js, which builds the lab
# extension, behind a TLS-inspecting proxy, e.g. -v /etc/ssl/certs:/etc/ssl/certs:ro
# --build-arg NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
ARG NODE_EXTRA_CA_CERTS=""
ARG LABEXTENSION=""

# Owned by the notebook user, so notebooks can write checkpoints and reports next to themselves.
COPY --chown=${NB_UID}:${NB_GID} . "${WORKBENCH_HOME}"
WORKDIR "${WORKBENCH_HOME}"
# With LABEXTENSION the built bundle is in place before the install, so the wheel's build hook
# (skip-if-exists in pyproject.toml) ships it instead of running jlpm.
RUN if [[ -n "${LABEXTENSION}" ]]; then \
        [[ -f "${LABEXTENSION}/static/style.js" && -f "${LABEXTENSION}/package.json" ]] || { \
            echo "LABEXTENSION=${LABEXTENSION}: no built lab extension there (static/style.js," \
                 "package.json); run make first or leave LABEXTENSION empty" >&2; exit 1; }; \
        cp -r "${LABEXTENSION}" workbench/ui/lab/labextension; \
    fi && \
    bash binder/install.sh "${WORKBENCH_HOME}" && \
    rm -rf "/home/${NB_USER}/.cache/yarn" "/home/${NB_USER}/.yarn/berry/cache" && \
    if command -v mamba >/dev/null; then \
        mamba clean --all --yes --quiet && \
        fix-permissions "${CONDA_DIR}" && fix-permissions "/home/${NB_USER}"; \
    fi

# Size the CPU ranks' thread pools to the container's CPU quota at every start (start.sh
# sources *.sh hooks from this folder).
USER root
RUN cp binder/cpu_threads.sh /usr/local/bin/before-notebook.d/20-workbench-cpu-threads.sh && \
    chmod 0644 /usr/local/bin/before-notebook.d/20-workbench-cpu-threads.sh
USER ${NB_UID}

EXPOSE 8888
# Jupyter Server answers /api (its version) without a token once it is up.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/api' % os.environ.get('JUPYTER_PORT', '8888'), timeout=4)"]

CMD ["start-notebook.py", "--ServerApp.root_dir=/home/jovyan/colossal-workbench/notebooks"]


# The image's own test: the quickstart, executed by nbclient on the image's kernel, as a user
# of the image would run it (no container runtime needed: it is a build step).
FROM playground AS test
RUN python deploy/image/check_quickstart.py notebooks/00_quickstart.ipynb /tmp/quickstart-checked


# The default target: the playground, built only once its test stage has passed.
FROM playground
COPY --from=test /tmp/quickstart-checked/verdict.txt /tmp/workbench-quickstart-verdict.txt
