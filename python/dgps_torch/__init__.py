"""dgps_torch: dgps's DGPS recurrences as PyTorch operators (torch.ops.dgps.*), with FLA's function names.

Swap `from fla.ops.gated_delta_rule import chunk_gated_delta_rule` for
`from dgps_torch import chunk_gated_delta_rule`: same arguments, defaults and results (docs/python.md).
"""
import torch

from . import _ops  # noqa: F401  (loads the operator library)
from .core import recurrence
from .serve import pool_recurrence
from .fla import (chunk_delta_rule, chunk_gated_delta_rule, chunk_gla, chunk_kda, chunk_precond_gated_delta_rule,
                  chunk_precond_kda, chunk_simple_gla, fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule,
                  fused_recurrent_kda, fused_recurrent_precond_gated_delta_rule, fused_recurrent_precond_kda,
                  fused_recurrent_simple_gla)

__version__ = "0.1.0"

chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
fused_recurrent_pgdn = fused_recurrent_precond_gated_delta_rule


def compiled_models():
    """The models compiled for every dtype in this build (others need a DGPS_TORCH_DYNAMIC build)."""
    return torch.ops.dgps.compiled_models()


def has_cuda():
    """True when this build has the CUDA operators."""
    return torch.ops.dgps.has_cuda()


__all__ = ["recurrence", "pool_recurrence", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
           "fused_recurrent_kda", "chunk_precond_gated_delta_rule", "fused_recurrent_precond_gated_delta_rule",
           "chunk_precond_kda", "fused_recurrent_precond_kda", "chunk_delta_rule", "fused_recurrent_delta_rule",
           "chunk_gla", "chunk_simple_gla", "fused_recurrent_simple_gla", "chunk_gdn", "fused_recurrent_gdn",
           "fused_recurrent_pgdn", "compiled_models", "has_cuda"]
