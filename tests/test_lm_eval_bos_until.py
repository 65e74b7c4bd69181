"""lm-eval parity beyond the plain tiny tokenizer: log-likelihoods of pre-rendered lm-eval prompts
with a tokenizer that adds a BOS token, and greedy answers of ``generate_until`` tasks that stop
at the task's ``until`` sequences, both against lm-eval 0.4.13's own HFLM (offline, local task
YAML on local rows)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_lm_eval_task import ARC_YAML, ROWS

from llm_calib.data import load
from llm_calib.engine.decode import greedy_loop
from llm_calib.engine.generation import finish_answer
from llm_calib.models import tiny_random_model

GEN_YAML = """\
task: toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{q}}}}\\nA:"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""

CAPS = [{"q": "Capital of France?", "a": "Paris"}, {"q": "Capital of Italy?", "a": "Rome"}, {"q": "2 + 2?", "a": "4"}]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _bos_tiny():
    """The tiny model with a tokenizer that adds ``<|im_start|>`` as BOS (as Llama tokenizers do)."""
    from tokenizers.processors import TemplateProcessing

    model, tok = tiny_random_model()
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", bos)])
    tok.bos_token = "<|im_start|>"
    assert tok("x")["input_ids"][0] == bos
    return model, tok


def _requests(task_dir: Path, name: str, num_fewshot: int = 0) -> list:
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(task_dir), include_defaults=False).load([name])["tasks"][name]
    task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests()
    return sorted(task.instances, key=lambda i: (i.doc_id, i.idx))


def test_loglikelihoods_match_lm_eval_with_a_bos_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from llm_calib.scoring import score_option_likelihood

    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "toy_arc_easy.yaml").write_text(ARC_YAML.format(data=tmp_path / "arc.jsonl", cache=tmp_path / "c"))
    recs = load(f"lm_eval:toy_arc_easy:include={tmp_path},num_fewshot=2").records
    model, tok = _bos_tiny()  # it has a chat template too: a rendered lm-eval prompt stays plain text
    scored = score_option_likelihood(model, tok, recs)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    reqs = _requests(tmp_path, "toy_arc_easy", 2)
    theirs = [ll for ll, _greedy in lm.loglikelihood(reqs)]
    ours = [ll for d in scored.details for ll in d["loglik"]]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)  # float32 forward passes
    context, _ = lm._encode_pair(reqs[0].args[0], reqs[0].args[1])
    assert context[0] == tok.bos_token_id  # lm-eval puts the BOS token first; so do we


def _gen_task(tmp_path: Path, until: list[str]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "caps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CAPS))
    (tmp_path / "toy_gen.yaml").write_text(
        GEN_YAML.format(data=tmp_path / "caps.jsonl", cache=tmp_path / "c", until=json.dumps(until)))
    return tmp_path


def test_generation_stops_at_the_tasks_until_sequences_as_lm_eval(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from llm_calib.confidence.token import encode_open_prompts, generate_greedy, score_open_ended

    model, tok = tiny_random_model(seed=0, init_std=0.1)
    # stop sequences taken from the middle of the model's own free answers, so that each one stops early
    recs = load(f"lm_eval:toy_gen:include={_gen_task(tmp_path / 'free', ['@@@'])}").records
    free = generate_greedy(model, tok, encode_open_prompts(tok, recs), max_new_tokens=12, stop_at_newline=False)
    texts = [tok.decode(list(a.token_ids)) for a in free]
    until = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]
    task_dir = _gen_task(tmp_path / "stops", until)
    recs = load(f"lm_eval:toy_gen:include={task_dir}").records
    assert all(r.until == tuple(until) for r in recs)

    ours = score_open_ended(model, tok, recs, max_new_tokens=12)
    assert [d["stop"] for d in ours.details] == ["until"] * len(recs)
    for text, answer in zip(texts, ours.answers, strict=True):
        assert len(answer) < len(text.strip())  # cut before the end of the free answer
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    theirs = lm.generate_until(_requests(task_dir, "toy_gen"))
    assert ours.answers == [t.strip() for t in theirs]
    # the confidence covers the answer's tokens only: fewer than generated
    assert all(len(p) < 12 for p in ours.token_probs)


def test_greedy_loop_until_keeps_the_tokens_before_the_stop_sequence() -> None:
    """A scripted model: row 0 writes 'ab' then 'cd' ('c' stops it), row 1 never meets its
    stop sequence and runs to the budget; newlines do not stop a row with stop sequences."""
    _, tok = tiny_random_model()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d", "Ċ")}  # Ċ: byte-level newline
    script = [[ids["a"], ids["Ċ"]], [ids["b"], ids["a"]], [ids["c"], ids["b"]], [ids["d"], ids["a"]]]
    vocab = len(tok)

    def logits_of(step: int, rows: list[int]):
        import torch

        z = torch.zeros(len(rows), vocab)
        for r, b in enumerate(rows):
            z[r, script[min(step, 3)][b]] = 5.0
        return z

    state = {"t": 0, "rows": [0, 1]}

    def step(tokens, keep):
        state["t"] += 1
        if keep is not None:
            state["rows"] = [state["rows"][int(k)] for k in keep]
        return logits_of(state["t"], state["rows"])

    outs = greedy_loop(step, logits_of(0, [0, 1]), tok, {tok.eos_token_id}, max_new_tokens=4,
                       drop_finished=True, until=[("c",), ("zz",)])
    (a0, _), (a1, _) = outs
    assert (a0.text, a0.stop, len(a0.token_ids)) == ("ab", "until", 2)
    assert a1.stop == "length" and a1.text == tok.decode([ids["Ċ"], ids["a"], ids["b"], ids["a"]]).strip()
    # finish_answer alone: an answer empty before the stop sequence takes the stop token's probability
    empty = finish_answer(tok, [ids["c"]], [0.25], {tok.eos_token_id}, until=("c",))
    assert (empty.text, empty.token_ids, empty.token_probs, empty.stop) == ("", (), (0.25,), "until")
