"""The ui layer: drawing what the ranks publish, in the notebook (``dashboard/``) and for the
JupyterLab server (``lab/``: its server extension and the pages it serves).

It registers itself with the pool (``workbench.pool.state``) so the pool publishes to it
without importing it: the pool layer stays below this one.
"""
