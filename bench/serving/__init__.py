"""The serving endpoint under load against calling the engine directly, and the soak run.

``python -m bench serving`` (or ``python -m bench.serving``) runs it; its parts: run (the load
and its table), soak (``--soak``: a real ``workbench serve`` for minutes).
"""

from bench.serving.run import main

__all__ = ["main"]
