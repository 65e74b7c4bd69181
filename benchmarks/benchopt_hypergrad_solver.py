"""A benchopt ``Solver`` for benchmark_bilevel that runs hypergrad's first-order methods inside it.

hypergrad's ``Penalty`` (F2SA) or ``BOME`` run through :func:`hypergrad.solve` on the benchmark's
own objective: its jax losses ``f_inner`` / ``f_outer`` (minibatches given by a start index) are
bridged to torch by a first-order ``torch.autograd.Function`` whose backward returns the jax
gradients (these two methods need no second derivatives, so the bridge is exact). The bridge
costs a jax call and two host copies per oracle: use this file to check hypergrad's algorithms
inside benchopt (same objective, metrics, plots); time them with
``benchmarks/hypergrad_benchopt.py``, which runs hypergrad on native torch losses.

Use it::

    git clone https://github.com/benchopt/benchmark_bilevel
    cp benchmarks/benchopt_hypergrad_solver.py benchmark_bilevel/solvers/hypergrad_first_order.py
    pip install -e /path/to/llm-calib          # hypergrad, in the environment benchopt runs in
    benchopt run benchmark_bilevel -d "simulated[n_samples_inner=2048]" \\
        -s "hypergrad[method=penalty]" -s "hypergrad[method=bome]" -s F2SA -s BOME --max-runs 50

Parameters: ``method`` (``"penalty"`` or ``"bome"``), ``step_size`` (inner SGD and, divided by
``outer_ratio``, the outer SGD), ``n_inner_steps`` (``T``), ``sigma`` (Penalty) and ``eta``
(BOME, gradient barrier as the benchmark's ``choice_phi="grad_norm"``), ``batch_size`` (Penalty;
BOME uses full batches like the benchmark's BOME) and ``eval_freq`` (outer steps per callback).
"""

import dataclasses
from typing import ClassVar

from benchopt import BaseSolver, safe_import_context
from benchopt.stopping_criterion import SufficientProgressCriterion

with safe_import_context() as import_ctx:
    from functools import partial

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import hypergrad as hg


def jax_first_order_loss(value_and_grad):
    """A torch loss ``(w, lam, start) -> scalar`` from a jitted jax ``value_and_grad`` of
    ``f(inner_var, outer_var, start)`` w.r.t. both variables; first order only."""

    class JaxLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, x, start):
            value, (grad_y, grad_x) = value_and_grad(jnp.asarray(y.detach().numpy()),
                                                     jnp.asarray(x.detach().numpy()), start)
            ctx.save_for_backward(torch.from_numpy(np.array(grad_y)), torch.from_numpy(np.array(grad_x)))
            return torch.tensor(float(value), dtype=y.dtype)

        @staticmethod
        def backward(ctx, grad_output):
            grad_y, grad_x = ctx.saved_tensors
            return grad_output * grad_y, grad_output * grad_x, None

    return lambda w, lam, start: JaxLoss.apply(w["y"], lam["x"], start)


class Solver(BaseSolver):
    """hypergrad's Penalty (F2SA) or BOME through hypergrad.solve."""

    name = "hypergrad"
    requirements: ClassVar[list[str]] = ["pip::torch", "jax"]
    stopping_criterion = SufficientProgressCriterion(patience=12_800, strategy="callback")
    parameters: ClassVar[dict[str, list]] = {
        "method": ["penalty"],
        "step_size": [0.1],
        "outer_ratio": [1.0],
        "n_inner_steps": [1],
        "sigma": [0.01],
        "eta": [0.5],
        "batch_size": [64],
        "eval_freq": [16],
        "random_state": [1],
    }

    @staticmethod
    def get_next(stop_val):
        return stop_val + 1

    def set_objective(self, f_inner, f_outer, n_inner_samples, n_outer_samples, inner_var0, outer_var0):
        torch.set_num_threads(1)
        full = self.method == "bome"
        self.n_inner = n_inner_samples
        self.n_outer = n_outer_samples
        self.batch_inner = n_inner_samples if full else self.batch_size
        self.batch_outer = n_outer_samples if full else self.batch_size

        def loss(f, batch_size):
            grad = jax.jit(jax.value_and_grad(partial(f, batch_size=batch_size), argnums=(0, 1)))
            return jax_first_order_loss(grad)

        self.problem = hg.BilevelProblem(inner=loss(f_inner, self.batch_inner), outer=loss(f_outer, self.batch_outer))
        step, outer_step = self.step_size, self.step_size / self.outer_ratio
        if self.method == "penalty":
            self.hg_method = hg.Penalty(sigma=self.sigma, inner_optimizer=hg.inner.SGD(lr=step),
                                        inner_steps=self.n_inner_steps)
        elif self.method == "bome":
            self.hg_method = hg.BOME(hg.inner.SGD(lr=step), w_lr=step, inner_steps=self.n_inner_steps,
                                     eta=self.eta, barrier="gradient")
        else:
            raise ValueError(f"method must be 'penalty' or 'bome', got {self.method!r}")
        self.outer_optimizer = lambda params: torch.optim.SGD(params, lr=outer_step)
        self.inner_var0, self.outer_var0 = inner_var0, outer_var0
        self.run_once(2)

    def _starts(self, n_samples, batch_size, rng):
        """Start indices of contiguous batches, reshuffled each epoch (the benchmark's sampler)."""
        n_batches = (n_samples + batch_size - 1) // batch_size
        while True:
            for i in rng.permutation(n_batches):
                yield int(i) * batch_size

    def run(self, callback):
        rng = np.random.default_rng(self.random_state)
        w = {"y": torch.from_numpy(np.array(self.inner_var0, dtype=np.float32))}
        lam = {"x": torch.from_numpy(np.array(self.outer_var0, dtype=np.float32))}
        inner_starts = self._starts(self.n_inner, self.batch_inner, rng)
        outer_starts = self._starts(self.n_outer, self.batch_outer, rng)
        state = None
        self.inner_var, self.outer_var = jnp.asarray(w["y"].numpy()), jnp.asarray(lam["x"].numpy())
        while callback():
            res = hg.solve(self.problem, w, lam, self.hg_method, self.outer_optimizer, steps=self.eval_freq,
                           inner_steps=0, inner_batches=[next(inner_starts) for _ in range(self.eval_freq)],
                           outer_batches=[next(outer_starts) for _ in range(self.eval_freq)], progress=False,
                           state=state)
            # the next chunk brings its own batches: continue the run's state with fresh streams
            w, lam, state = res.w, res.lam, dataclasses.replace(res.state, streams={})
            self.inner_var, self.outer_var = jnp.asarray(w["y"].numpy()), jnp.asarray(lam["x"].numpy())

    def get_result(self):
        return dict(inner_var=self.inner_var, outer_var=self.outer_var)
