"""hypergrad: hypergradients of bilevel problems in PyTorch.

Exact implicit differentiation, unrolled differentiation and first-order methods behind one
interface: ``method.hypergrad(problem, w, lam, inner_batch, outer_batch) -> HypergradResult``.
"""

from hypergrad import linear
from hypergrad.errors import ConvergenceWarning, NonFiniteError
from hypergrad.implicit import Implicit
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradMethod, HypergradResult

__all__ = [
    "BilevelProblem",
    "ConvergenceWarning",
    "HypergradInfo",
    "HypergradMethod",
    "HypergradResult",
    "Implicit",
    "NonFiniteError",
    "linear",
]

__version__ = "0.1.0"
