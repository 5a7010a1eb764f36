"""The notebook's side of inference: ``RemoteEngine`` (``remote_engine.py``), a handle on an
inference ``Engine`` living on the ranks, and the functions the ranks run to publish a
generation's progress (``generation_calls.py``).

It sits beside ``serving/`` (an HTTP endpoint over the same engines), above the ui layer whose
dashboard it shows while a generation runs.
"""

from workbench.inference.remote_engine import RemoteEngine

__all__ = ["RemoteEngine"]
