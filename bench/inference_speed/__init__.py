"""Every speed figure of serving and inference in one run, side by side: served / direct,
engine / HF ``generate``, continuous / static batching, prefix sharing, prompt-lookup and
draft-model speculation, pp=2 overlap, and the disk tier's step against its bandwidth bound.

``python -m bench inference_speed`` runs ``bench serving``, ``bench inference`` and ``bench
memory``'s speed part one after another on the same machine, each printing its own full report,
then a summary table with the machine's load average beside each part (the figures are ratios
taken within each part, rounds interleaved, so the parts need not share a moment).
"""

from bench.inference_speed.run import main

__all__ = ["main"]
