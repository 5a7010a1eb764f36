# Sourced at every container start (binder/start; the Dockerfile installs it as a
# docker-stacks before-notebook.d hook): give each CPU rank its share of the container's cores.
#
# kernels_runtime gives each of the N ranks on a host os.cpu_count() // N threads unless
# OMP_NUM_THREADS is set. In a container os.cpu_count() counts the host's cores, not the
# container's CPU quota (Binder: about 2 cores of a much larger host), so the 2 ranks of the
# notebooks would each start dozens of threads on 2 cores and run many times slower. Read the
# cgroup quota (v2 cpu.max, or v1 cfs quota/period) and split it over WORKBENCH_RANKS_PER_HOST
# ranks (default 2). No quota, or OMP_NUM_THREADS already set: nothing changes.
workbench_cpu_threads() {
    local root="${WORKBENCH_CGROUP_DIR:-/sys/fs/cgroup}" quota="" period=""
    if [[ -r "${root}/cpu.max" ]]; then
        read -r quota period <"${root}/cpu.max" || true
    elif [[ -r "${root}/cpu/cpu.cfs_quota_us" && -r "${root}/cpu/cpu.cfs_period_us" ]]; then
        quota="$(<"${root}/cpu/cpu.cfs_quota_us")"
        period="$(<"${root}/cpu/cpu.cfs_period_us")"
    fi
    [[ "${quota}" =~ ^[0-9]+$ && "${period}" =~ ^[1-9][0-9]*$ ]] || return 0
    local cpus=$(((quota + period - 1) / period))
    local ranks="${WORKBENCH_RANKS_PER_HOST:-2}"
    local threads=$((cpus / ranks))
    echo $((threads > 0 ? threads : 1))
}
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    _workbench_threads="$(workbench_cpu_threads)"
    if [[ -n "${_workbench_threads}" ]]; then
        export OMP_NUM_THREADS="${_workbench_threads}"
    fi
    unset _workbench_threads
fi
