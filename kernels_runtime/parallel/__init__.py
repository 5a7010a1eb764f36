"""Parallel strategies of the runtime, one package per strategy.

``data/`` (DDP, ZeRO), ``tensor/``, ``pipeline/`` and ``sequence/`` each keep their algorithm and
their collectives in separate files, so a reader finds a strategy by name. Cross-cutting memory
savers that need no process group, such as activation checkpointing, sit beside them as modules.
"""
