"""CALM inside TRL's ``SFTTrainer``: :class:`CalmSFTTrainer` (needs ``trl``: ``pip install 'llm-calib[trl]'``).

``SFTTrainer`` keeps everything it does for the data (prompt/completion rows, chat ``messages``,
its chat template and tokenisation, completion-only or assistant-only labels, padding-free
batches, its ``SFTConfig``, a ``peft_config``); :class:`~llm_calib.integrations.trainer.CalmTrainerMixin`
replaces the loss and the optimiser step by CALM steps on its causal-LM batches. The upper level
reads prompts: ``upper_dataset`` rows in TRL's prompt-only form (``{"prompt": ...}``, tokenised as
``SFTTrainer`` tokenises a prompt, by :class:`~llm_calib.integrations.PromptCollator`), or by
default the evaluation set's prompts (each sequence up to its first labelled token).
"""

from __future__ import annotations

from typing import Any

from llm_calib.integrations.trainer import CalmTrainerMixin

try:
    from trl import SFTTrainer
except ImportError as err:  # pragma: no cover - the trl extra
    raise ImportError("llm_calib.integrations.trl needs TRL: pip install 'llm-calib[trl]' (trl==1.16.0)") from err

__all__ = ["CalmSFTTrainer"]


class CalmSFTTrainer(CalmTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` taking CALM steps: its arguments plus ``calm_config``, ``upper_dataset``,
    ``upper_collator``, ``upper_batch_size`` and ``calm_sampler``
    (:class:`~llm_calib.integrations.trainer.CalmTrainerMixin`).

    Example:
        >>> import tempfile
        >>> from peft import LoraConfig
        >>> from transformers import PrinterCallback
        >>> from trl import SFTConfig
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> rows = [{"prompt": [{"role": "user", "content": f"{a} + {a} ="}], "completion": [{"role": "assistant",
        ...          "content": str(2 * a)}]} for a in range(8)]
        >>> args = SFTConfig(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, report_to="none",
        ...                  save_strategy="no", disable_tqdm=True, use_cpu=True)
        >>> trainer = CalmSFTTrainer(model=model, args=args, train_dataset=_dataset(rows[:4]),
        ...                          eval_dataset=_dataset(rows[4:]), processing_class=tok,
        ...                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        >>> trainer.remove_callback(PrinterCallback)
        >>> trainer.train().global_step, "eval_ece" in trainer.evaluate()
        (2, True)
    """


def _dataset(rows: list[dict[str, Any]]) -> Any:
    """A ``datasets.Dataset`` of ``rows`` (for the example)."""
    from datasets import Dataset

    return Dataset.from_list(rows)
