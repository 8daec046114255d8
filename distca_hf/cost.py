"""Cost of core attention, counted in query-key pairs and FLOPs.

Units: pairs are (query token, key token) couples that the causal mask keeps; FLOPs count a
multiply-add as 2. The profiled time model arrives with the planner.
"""

from __future__ import annotations

__all__ = ["causal_pairs", "document_pairs", "attention_flops"]


def causal_pairs(q_start: int, q_end: int) -> int:
    """Pairs of the queries ``[q_start, q_end)`` of a document, bottom-right causal:
    ``sum(t + 1 for t in range(q_start, q_end))``."""
    return (q_end * (q_end + 1) - q_start * (q_start + 1)) // 2


def document_pairs(length: int) -> int:
    """Pairs of a whole causal document of ``length`` tokens."""
    return causal_pairs(0, length)


def attention_flops(pairs: int, num_heads: int, head_dim: int, backward: bool = False) -> int:
    """FLOPs of core attention over ``pairs`` query-key pairs.

    Forward is two matmuls (QK^T and PV): ``4 * pairs * heads * head_dim``. Backward recomputes QK^T
    and runs four more matmuls (dV, dP, dQ, dK), 2.5x the forward; ``backward=True`` returns
    forward + backward.
    """
    forward = 4 * pairs * num_heads * head_dim
    return forward * 7 // 2 if backward else forward
