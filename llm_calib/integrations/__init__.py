"""CALM inside the training pipelines people already run.

* :class:`CalmStep`: one CALM update of θ and λ that any PyTorch loop calls in place of its
  optimiser step, with ``state_dict`` / ``load_state_dict``.
* :class:`MultipleChoiceCollator`, :class:`OpenAnswerCollator`: questions -> the batches it takes
  (multiple choice: llm-calib's option-likelihood batch; open answers: a Hugging Face causal-LM batch).
* :class:`~llm_calib.integrations.trainer.CalmTrainer`: ``transformers.Trainer`` taking CALM steps;
  :class:`~llm_calib.integrations.trl.CalmSFTTrainer`: the same for TRL's ``SFTTrainer``.
* :func:`~llm_calib.integrations.model_card.write_model_card`: a Hugging Face model card of a CALM run.

See the tutorial :doc:`/tutorials/fine_tuning_scripts`.
"""

from llm_calib.integrations.batches import IGNORE_INDEX, labelled_sequences, prompt_sequences
from llm_calib.integrations.collators import (
           MultipleChoiceCollator,
           OpenAnswerCollator,
           PromptCollator,
)
from llm_calib.integrations.step import CalmStep, MicroBatches, TrainerAdam, attach_adapters

__all__ = ["IGNORE_INDEX", "CalmStep", "MicroBatches", "MultipleChoiceCollator", "OpenAnswerCollator", "PromptCollator",
           "TrainerAdam", "attach_adapters", "labelled_sequences", "prompt_sequences"]
