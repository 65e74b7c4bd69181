"""The seeded batch order of a calibration run, and its split over data-parallel ranks.

Each record set is read in its own stream: per epoch a permutation seeded by (seed, epoch, stream)
cut into batches, so resumed runs, more ranks and replayed steps all see the same batches.
"""

from __future__ import annotations

import torch

from llm_calib import distributed

__all__ = ["TRAIN_STREAM", "UPPER_STREAM", "batch_indices", "shard"]

TRAIN_STREAM = 0
"""Stream of the training questions (lower level, and the one-level baselines' loss)."""

UPPER_STREAM = 1
"""Stream of the unlabelled upper-level inputs (CALM's f, the confidence penalty's entropy)."""


def batch_indices(n: int, batch_size: int, step: int, seed: int, stream: int) -> list[int]:
    """The global batch of ``step`` (0-based): consecutive slices of a per-epoch seeded permutation.

    An epoch has ``max(1, n // batch_size)`` batches (a remainder is dropped); with
    ``batch_size >= n`` every batch is the whole permuted set.

    Raises:
        ValueError: ``n`` or ``batch_size`` below 1.

    Example:
        >>> a = batch_indices(10, 4, step=0, seed=0, stream=0)
        >>> b = batch_indices(10, 4, step=1, seed=0, stream=0)
        >>> len(a), len(b), set(a) & set(b)
        (4, 4, set())
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 7919 + stream)
    perm = torch.randperm(n, generator=gen).tolist()
    if batch_size >= n:
        return perm
    return perm[k * batch_size : (k + 1) * batch_size]


def shard(indices: list[int]) -> list[int]:
    """This rank's part of a global batch (every ``world_size``-th index from its rank).

    Raises:
        ValueError: the batch size is not divisible by the number of ranks.

    Example:
        >>> shard([3, 1, 2, 0])   # one process: the whole batch
        [3, 1, 2, 0]
    """
    world, rank = distributed.world_size(), distributed.rank()
    if world == 1:
        return indices
    if len(indices) % world:
        raise ValueError(f"the batch size {len(indices)} must be divisible by the number of ranks {world}")
    return indices[rank::world]
