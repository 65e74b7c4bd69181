"""The one option-scoring forward pass: :func:`forward_rows` (decoder, hidden states at
``packed.rows``, optionally the trunk entering layer ``k``) then :func:`target_logprobs` (head,
log-softmax, gather of the scored tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from llm_calib.engine.packing import (
    PackedQuestions,
    accepts_packed_masks,
    gather_token_logprobs,
    option_sequences,
)
from llm_calib.models import lm_head_logits, split_decoder_head

__all__ = ["capture_layer_input", "compute_dtype", "forward_rows", "loaded_precision", "target_logprobs"]


@contextlib.contextmanager
def capture_layer_input(decoder: Any, index: int) -> Iterator[dict[str, Tensor]]:
    """Record as ``box["hidden"]`` the hidden states entering ``decoder.layers[index]`` during a forward pass.

    Example:
        >>> import torch
        >>> from llm_calib.models import split_decoder_head, tiny_random_model
        >>> decoder, _ = split_decoder_head(tiny_random_model()[0])
        >>> with capture_layer_input(decoder, 1) as box:
        ...     _ = decoder(input_ids=torch.tensor([[5, 6, 7]]))
        >>> box["hidden"].shape[:2]
        torch.Size([1, 3])
    """
    box: dict[str, Tensor] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        box["hidden"] = args[0] if args else kwargs["hidden_states"]

    handle = decoder.layers[index].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield box
    finally:
        handle.remove()


def compute_dtype(model: Any) -> torch.dtype:
    """The compute dtype of a causal LM: its input embeddings' (quantised weights are integers), else its first
    float parameter's.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> compute_dtype(tiny_random_model()[0])
        torch.float32
    """
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def loaded_precision(model: Any) -> dict[str, str | None]:
    """What a loaded model computes with, as a run records it: ``dtype`` (:func:`compute_dtype`;
    with 4/8-bit weights the dtype they are computed in, not the requested one), ``quantization``
    (``"4-bit NF4"``, ``"4-bit FP4"``, ``"8-bit LLM.int8"`` or None) and ``device``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> loaded_precision(tiny_random_model()[0])
        {'dtype': 'float32', 'quantization': None, 'device': 'cpu'}
    """
    quantization = None
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    if getattr(model, "is_loaded_in_4bit", False) or (config is not None and get("load_in_4bit")):
        quantization = f"4-bit {str(get('bnb_4bit_quant_type') or 'nf4').upper()}" if config is not None else "4-bit"
    elif getattr(model, "is_loaded_in_8bit", False) or (config is not None and get("load_in_8bit")):
        quantization = "8-bit LLM.int8"
    param = next(iter(model.parameters()), None)
    return {"dtype": str(compute_dtype(model)).removeprefix("torch."), "quantization": quantization,
            "device": None if param is None else str(param.device)}


def forward_rows(
    model: Any, packed: PackedQuestions, *, trunk_layer: int = 0, packed_masks: bool | None = None,
    parameters: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Final hidden states at ``packed.rows`` of one decoder pass over a packed batch.

    Without 4-D mask support (or ``packed_masks=False``) each option runs as its own sequence
    (:func:`~llm_calib.engine.packing.option_sequences`): same contexts, same rows.

    Args:
        model: a Hugging Face causal LM (not a peft wrapper).
        packed: the batch.
        trunk_layer: when > 0, also return the ``(B, L, hidden)`` states entering this layer.
        packed_masks: whether to use the 4-D mask (default: whether the model accepts it).
        parameters: decoder parameters to substitute through :func:`torch.func.functional_call`.

    Returns:
        ``(hidden, trunk)``: ``(len(packed.rows), hidden)`` and the trunk (None without ``trunk_layer``).

    Example:
        >>> import torch
        >>> from llm_calib.engine.packing import pack_questions
        >>> from llm_calib.models import tiny_random_model
        >>> model, _ = tiny_random_model()
        >>> p = pack_questions([((5, 6), ((7,), (8, 9)))], pad_id=0)
        >>> h, trunk = forward_rows(model, p, trunk_layer=1)
        >>> h.shape[0], trunk.shape[:2]
        (2, torch.Size([1, 5]))
    """
    if packed_masks is None:
        packed_masks = accepts_packed_masks(model)
    if packed.attention_mask.dim() == 4 and not packed_masks:
        seq = option_sequences(packed)
        hidden, trunk = forward_rows(model, seq.packed, trunk_layer=trunk_layer, parameters=parameters)
        if trunk is not None:
            B, L = packed.input_ids.shape
            trunk = trunk.reshape(-1, trunk.shape[-1])[seq.target.to(trunk.device)].reshape(B, L, -1)
        return hidden, trunk
    decoder, _ = split_decoder_head(model)
    device = next(decoder.parameters()).device
    on = packed.on(device)  # copied to the device once per batch, not once per pass
    mask = on.additive_mask(compute_dtype(model)) if on.attention_mask.dim() == 4 else on.attention_mask
    kwargs = {"input_ids": on.input_ids, "attention_mask": mask, "position_ids": on.position_ids, "use_cache": False}
    with capture_layer_input(decoder, trunk_layer) if trunk_layer > 0 else contextlib.nullcontext({}) as box:
        if parameters is None:
            out = decoder(**kwargs)
        else:
            out = torch.func.functional_call(decoder, parameters, (), kwargs, strict=False)
    hidden = out.last_hidden_state
    trunk = box["hidden"] if trunk_layer > 0 else None
    return hidden.reshape(-1, hidden.shape[-1])[on.rows], trunk


def target_logprobs(model: Any, packed: PackedQuestions, hidden: Tensor | None = None) -> Tensor:
    """Log-probability of every scored token of ``packed`` (float32 for half-precision models).

    The head runs on the gathered rows only; ``hidden`` defaults to :func:`forward_rows`.

    Example:
        >>> from llm_calib.engine.packing import pack_letters
        >>> from llm_calib.models import tiny_random_model
        >>> model, _ = tiny_random_model()
        >>> lp = target_logprobs(model, pack_letters([(5, 6, 7)], [(8, 9)], pad_id=0))
        >>> lp.shape, bool((lp < 0).all())
        (torch.Size([2]), True)
    """
    if hidden is None:
        hidden, _ = forward_rows(model, packed)
    _, head = split_decoder_head(model)
    return gather_token_logprobs(lm_head_logits(model, head, hidden), packed)
