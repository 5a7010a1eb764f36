"""LoRA fine-tuning: memory against its formula, capacity under a budget, step speed.

``python -m bench finetune`` (or ``python -m bench.finetune``) runs it; its parts: run (the
three parts), memory, capacity, speed.
"""

from bench.finetune.run import main

__all__ = ["main"]
