"""The scoring engine: the batch layout (:mod:`~llm_calib.engine.packing`), the one
option-scoring pass (:mod:`~llm_calib.engine.options`) and the one greedy decoder
(:mod:`~llm_calib.engine.decode`), behind scoring, training and fast evaluation.
"""
