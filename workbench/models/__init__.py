"""Real pretrained models made available offline, as ``save_pretrained`` folders.

Importing this package imports no torch: a conversion imports transformers when it runs.
"""

from workbench.models.smollm2 import smollm2_instruct

__all__ = ["smollm2_instruct"]
