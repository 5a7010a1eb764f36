"""The workbench's version, alone in a module so that what compares versions (the pool's
check across hosts, the engines' ``identify``) need not import the package's public face,
which imports the pool: that made ``workbench`` and ``workbench.pool.ranks`` import each other."""

__version__ = "0.1.0"
