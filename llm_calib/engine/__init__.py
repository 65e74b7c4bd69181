"""The scoring engine: every pass of ``llm_calib`` over a causal LM's outputs goes through it.

* :mod:`~llm_calib.engine.packing`: the batch layout (questions packed one row each with a 4-D
  mask, letters, open answers), shared by scoring and the training objectives, and the gather of
  per-token and per-option log-probabilities from head logits.
* :mod:`~llm_calib.engine.options`: the one option-scoring forward pass
  (:func:`~llm_calib.engine.options.forward_rows`, :func:`~llm_calib.engine.options.target_logprobs`)
  behind the option-likelihood and letter scorers and fast evaluation, with trunk capture as an option.
* :mod:`~llm_calib.engine.decode`: the one greedy decoder
  (:func:`~llm_calib.engine.decode.greedy_loop`) behind
  :func:`~llm_calib.engine.decode.generate_greedy` (any causal LM) and
  :class:`~llm_calib.engine.decode.TrunkGenerator` (trunk caching for top-layer adapters).

The scorers (:mod:`llm_calib.scoring`), the CALM objectives and fast evaluation
(:mod:`llm_calib.calm.fast_eval`) are built on these three modules.
"""
