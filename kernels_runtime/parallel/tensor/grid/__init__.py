"""2D (SUMMA / Optimus, arXiv 2104.05343) and 2.5D (Tesseract, arXiv 2105.14500) tensor
parallelism: the kernels, as modules over the grid groups tp_row, tp_col and tp_dep.

Layout on rank (k, i, j) of d depths of q x q (``grid.py``): hidden states (b/(d*q), s, h/q),
batch chunk k*q + i, hidden chunk j; weight block W[i, j], the same on every depth. Each
algorithm sits beside the collectives it uses: ``grid_comms.py`` (SUMMA's broadcasts and
reduces, the norms' sums, the embedding's swap) under ``linear.py`` (``Linear2D``), ``norm.py``
(``LayerNorm2D``, ``RMSNorm2D``), ``embedding.py`` (``Embedding2D``, the tied ``LMHead2D``) and
``cross_entropy.py``; ``layout.py`` crosses between full tensors and blocks at a model's input
and output, and ``sharding.py`` cuts whole parameters into blocks with their ``ParamLayout``.
"""

from kernels_runtime.parallel.tensor.grid.cross_entropy import grid_cross_entropy
from kernels_runtime.parallel.tensor.grid.embedding import Embedding2D, LMHead2D
from kernels_runtime.parallel.tensor.grid.grid import Grid
from kernels_runtime.parallel.tensor.grid.layout import gather_hidden, scatter_hidden, scatter_ids
from kernels_runtime.parallel.tensor.grid.linear import Linear2D
from kernels_runtime.parallel.tensor.grid.norm import LayerNorm2D, RMSNorm2D
from kernels_runtime.parallel.tensor.grid.sharding import (
    chunk_replica,
    grid_vocab_range,
    split_features,
    split_vocab,
    split_weight,
    weight_replica,
)

__all__ = [
    "Embedding2D",
    "Grid",
    "LMHead2D",
    "LayerNorm2D",
    "Linear2D",
    "RMSNorm2D",
    "gather_hidden",
    "grid_cross_entropy",
    "grid_vocab_range",
    "chunk_replica",
    "scatter_hidden",
    "scatter_ids",
    "split_features",
    "split_vocab",
    "split_weight",
    "weight_replica",
]
