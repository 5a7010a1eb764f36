"""Loading a real checkpoint under a plan: host memory and time against ``from_pretrained``.

``python -m bench loading`` (or ``python -m bench.loading``) runs it; its parts: run (ranks and
table).
"""

from bench.loading.run import main

__all__ = ["main"]
