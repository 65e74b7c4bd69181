"""The scoring engine: the batch layout (:mod:`~llm_calib.engine.packing`), the one
option-scoring pass (:mod:`~llm_calib.engine.options`), the prefix cache that computes a prompt
prefix shared by several requests once (:mod:`~llm_calib.engine.prefix`), flat batches that score
a batch's tokens unpadded on those prefixes (:mod:`~llm_calib.engine.flat`) and the one greedy decoder
(:mod:`~llm_calib.engine.decode`), behind scoring, training and fast evaluation; every sequence
they are given fits the model's context (:mod:`~llm_calib.engine.context`).
"""
