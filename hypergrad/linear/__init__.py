"""Linear solvers for the implicit-function-theorem system, one per module.

Each solver is a frozen dataclass called as ``solver(system, x0=None) -> LinearSolveResult``.
"""

from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.linear.cg import CG
from hypergrad.linear.dense import Dense
from hypergrad.linear.neumann import Neumann, largest_eigenvalue
from hypergrad.linear.normal_cg import NormalCG

__all__ = ["CG", "Dense", "LinearSolveResult", "LinearSystem", "Neumann", "NormalCG", "largest_eigenvalue"]
