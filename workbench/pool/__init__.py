"""The pool layer: processes and ranks.

One ipyparallel engine per rank, called a *rank process* here (``rank_process.py`` is its entry
point) so that it is never confused with the inference ``Engine`` of ``kernels_runtime.inference``.
``pool.py`` starts, restarts and stops them; ``ranks.py`` and ``status.py`` answer questions about
them; ``world.py`` forms their process group; ``launchers.py``, ``forked_ranks.py`` and ``slurm.py``
start them locally, by fork, or under Slurm/MPI/SSH; ``reaper.py`` and ``cleanup.py`` make sure
none outlives its kernel; ``state.py`` publishes the pool's state to whoever registered (the ui
layer), so this layer never imports the one above; ``rank_calls.py`` holds the functions the ranks
run on the pool's behalf; ``engines.py`` holds the ipyparallel cluster behind ``pool.py``.
"""
