"""Analyses of trained re-param blocks: branch similarity and norms (paper Fig. "viz"), and
Proposition 1's exact update check (:mod:`orepa.analysis.proposition1`).

Depends on torch and the core library only (plots live in ``orepa.apps.analyze``, the
Proposition 1 experiment in ``orepa.apps.proposition1``).
"""
from .branches import (
    analyze_block,
    analyze_model,
    branch_kernels,
    channel_norms,
    cosine_matrix,
    find_blocks,
    mean_off_diagonal,
    normalized_sorted_norms,
)

__all__ = [
    "analyze_block", "analyze_model", "branch_kernels", "channel_norms", "cosine_matrix", "find_blocks",
    "mean_off_diagonal", "normalized_sorted_norms",
]
