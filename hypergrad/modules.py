"""Bridges between :class:`torch.nn.Module` and the pytree (``dict[str, Tensor]``) convention."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hypergrad.tree import Tree

__all__ = ["functional", "load_params", "module_params"]

Selector = None | str | Iterable[str] | Callable[[str, nn.Parameter], bool]


def _select(name: str, param: nn.Parameter, trainable: Selector) -> bool:
    if trainable is None:
        return param.requires_grad
    if isinstance(trainable, str):
        return fnmatch.fnmatchcase(name, trainable)
    if callable(trainable):
        return bool(trainable(name, param))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in trainable)


def module_params(module: nn.Module, trainable: Selector = None) -> Tree:
    """Return the chosen parameters of ``module`` as a ``dict[str, Tensor]`` of detached copies.

    Args:
        module: any :class:`torch.nn.Module`.
        trainable: which parameters become the pytree: None (those with ``requires_grad``), a
            glob pattern or list of patterns over parameter names (``"head.*"``), or a predicate
            ``(name, param) -> bool``.

    Raises:
        ValueError: when nothing matches.

    Example:
        >>> import torch, hypergrad as hg
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        >>> sorted(hg.module_params(net, trainable="1.*"))
        ['1.bias', '1.weight']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    out = {n: p.detach().clone() for n, p in module.named_parameters() if _select(n, p, trainable)}
    if not out:
        names = [n for n, _ in module.named_parameters()]
        raise ValueError(f"trainable={trainable!r} selects no parameter; available: {names[:20]}")
    return out


def functional(module: nn.Module) -> Callable[..., Any]:
    """Return ``call(w, *args, **kwargs)`` running ``module`` with ``w`` substituted.

    Parameters absent from ``w`` keep the module's own (frozen) values, so ``w`` can be any
    subset; the call is :func:`torch.func.functional_call` and composes with ``torch.func``
    transforms and with autograd.

    Args:
        module: any :class:`torch.nn.Module`; it is not modified.

    Returns:
        ``call(w, *args, **kwargs)``: the module's output with the tensors of ``w`` (parameter
        or buffer names) in place of its own.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: (from ``call``) ``w`` has a key that is neither a parameter nor a buffer.

    Example:
        >>> import torch, hypergrad as hg
        >>> net = torch.nn.Linear(2, 1)
        >>> call = hg.functional(net)
        >>> w = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> call(w, torch.tensor([[1.0, 2.0]])).item()
        3.0
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}

    def call(w: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(set(w) - known)
        if unknown:
            raise ValueError(f"w has keys that are not parameters of the module: {unknown[:10]}")
        return torch.func.functional_call(module, dict(w), args, kwargs, strict=False)

    return call


def load_params(module: nn.Module, w: Mapping[str, Tensor]) -> None:
    """Copy the tensors of ``w`` into the matching parameters of ``module`` in place.

    Args:
        module: the module to update (under ``torch.no_grad``).
        w: a dict of parameter names to tensors (any subset of the parameters).

    Raises:
        ValueError: a key of ``w`` is not a parameter of ``module``, or its shape differs.

    Example:
        >>> import torch, hypergrad as hg
        >>> net = torch.nn.Linear(2, 1)
        >>> hg.load_params(net, {"bias": torch.tensor([5.0])})
        >>> net.bias.item()
        5.0
    """
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in w.items():
            if name not in params:
                raise ValueError(f"w[{name!r}] is not a parameter of the module")
            if params[name].shape != value.shape:
                raise ValueError(f"w[{name!r}] has shape {tuple(value.shape)}, parameter has {tuple(params[name].shape)}")
            params[name].copy_(value)
