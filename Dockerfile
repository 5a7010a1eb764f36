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
# The base images bring torch >= 2.4 (CPU or CUDA); binder/requirements.txt keeps it. The install
# itself is binder/install.sh, the same script Binder's postBuild runs and
# tests/test_binder_install.py checks.
ARG BASE_IMAGE=quay.io/jupyter/pytorch-notebook:2026-08-03
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV WORKBENCH_HOME="/home/${NB_USER}/colossal-workbench" \
    PIP_NO_CACHE_DIR=1

# Owned by the notebook user, so notebooks can write checkpoints and reports next to themselves.
COPY --chown=${NB_UID}:${NB_GID} . "${WORKBENCH_HOME}"

USER ${NB_UID}
WORKDIR "${WORKBENCH_HOME}"
RUN python -m pip install -r binder/requirements.txt && \
    bash binder/install.sh "${WORKBENCH_HOME}" && \
    mamba clean --all --yes --quiet && \
    rm -rf "/home/${NB_USER}/.cache/yarn" "/home/${NB_USER}/.yarn/berry/cache" && \
    fix-permissions "${CONDA_DIR}" && \
    fix-permissions "/home/${NB_USER}"

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
