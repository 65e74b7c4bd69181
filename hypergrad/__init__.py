"""hypergrad: hypergradients of bilevel problems in PyTorch.

Exact implicit differentiation, unrolled differentiation and first-order methods behind one
interface: ``method.hypergrad(problem, w, lam, inner_batch, outer_batch) -> HypergradResult``.
"""

from hypergrad import (
    autodiff,
    batched,
    batches,
    checkpoint,
    compiled,
    distributed,
    inner,
    linear,
    roots,
    stochastic,
    tree,
)
from hypergrad.alternating import AlternatingImplicit
from hypergrad.amigo import AmIGO
from hypergrad.batches import StepBatches
from hypergrad.bome import BOME
from hypergrad.checkpoint import SolveState, load_checkpoint, save_checkpoint
from hypergrad.driver import InnerSolveResult, SolveResult, inner_solve, solve
from hypergrad.errors import ConvergenceWarning, NonFiniteError
from hypergrad.finite_difference import FiniteDifference
from hypergrad.implicit import Implicit
from hypergrad.modules import functional, load_params, module_params
from hypergrad.penalty import Penalty
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradMethod, HypergradResult
from hypergrad.roots import custom_root
from hypergrad.saba import SABA
from hypergrad.soba import SOBA
from hypergrad.srba import SRBA
from hypergrad.stocbio import StocBiO
from hypergrad.unrolled import Unrolled

__all__ = [
    "BOME",
    "SABA",
    "SOBA",
    "SRBA",
    "AlternatingImplicit",
    "AmIGO",
    "BilevelProblem",
    "ConvergenceWarning",
    "FiniteDifference",
    "HypergradInfo",
    "HypergradMethod",
    "HypergradResult",
    "Implicit",
    "InnerSolveResult",
    "NonFiniteError",
    "Penalty",
    "SolveResult",
    "SolveState",
    "StepBatches",
    "StocBiO",
    "Unrolled",
    "autodiff",
    "batched",
    "batches",
    "checkpoint",
    "compiled",
    "custom_root",
    "distributed",
    "functional",
    "inner",
    "inner_solve",
    "linear",
    "load_checkpoint",
    "load_params",
    "module_params",
    "roots",
    "save_checkpoint",
    "solve",
    "stochastic",
    "tree",
]

__version__ = "0.1.0"
