"""The cell layer: running one notebook cell on the ranks and explaining what went wrong.

``execution.py`` streams a cell's output and handles failures, timeouts and interrupts;
``background.py`` runs it without blocking the notebook; ``oom_hint.py`` turns an out-of-memory
error into plans that fit; ``rank_fit.py`` says how many ranks this machine can hold.
"""
