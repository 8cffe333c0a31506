"""Analyses of trained re-param blocks (issue 5): branch similarity and norms, Proposition 1.

Depends on torch and the core library only (plots live in ``orepa.apps.analyze``).
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
