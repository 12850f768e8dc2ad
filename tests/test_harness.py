"""The lm-evaluation-harness model (diffgemma/harness.py) on an untrained tiny chat run (byte
tokenizer): generate_until gives evaluation.evaluate's (eval.py's) tokens and replies, in AR and
diffusion mode; loglikelihood equals a float64 numpy teacher-forced sum over the continuation
from the encoder's logits of the unpadded sequence, computed here independently (1e-4 absolute,
float32 model), and is_greedy an argmax check; loglikelihood_rolling equals the sum over its
windows, rebuilt by hand; lm_eval.simple_evaluate on the local chat task gives eval.py's
exact-match accuracy; errors are one line."""

import dataclasses
import functools
import os
import sys

import numpy as np
import pytest

import jax  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from diffgemma import errors, harness  # noqa: E402
from diffgemma.model import transformer  # noqa: E402
from diffgemma.sampling import sampler  # noqa: E402
from diffgemma.training import evaluation, loaded  # noqa: E402
from tests.helpers import (byte_ids, chat, run, save_sft_run, tiny_chat_config,  # noqa: E402
                           write_jsonl)

BOS = 2  # the byte tokenizer's
ATOL = 1e-4  # log-likelihoods: float32 model against the float64 reference
WORDS = ["cab", "hello", "zyx", "qwerty", "abc", "dcba"]  # 6 rows: batches of 4, the last padded


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("harness") / "run")
  save_sft_run(tiny_chat_config(prompt_len=32), path)  # P 32, 2 canvases of 8: budget 16
  return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return write_jsonl(tmp_path_factory.mktemp("data") / "sort.jsonl",
                     [chat(f"Sort: {w}", "".join(sorted(w))) for w in WORDS])


def recording(fn, calls):
  """`fn` with every call's output tokens kept."""
  def wrapped(*args):
    out = jax.tree_util.tree_map(np.asarray, fn(*args))
    calls.append(out.tokens)
    return out
  return wrapped


def eval_py(workdir, data, batch, **overrides):
  """(metrics, predictions, tokens of every sampler call) of eval.py's path: the run opened
  with the sampler overrides, its task reading the file, evaluation.evaluate."""
  run = loaded.open_run(workdir, **overrides).load()
  prompts = run.task.load_eval_file(data)
  calls = []
  fn = recording(sampler.make_generate_fn(run.model_cfg, run.sampler_cfg), calls)
  metrics, predictions = evaluation.evaluate(run.task, run.params, run.model_cfg,
                                             run.sampler_cfg, prompts, batch, seed=0,
                                             generate_fn=fn)
  return metrics, predictions, calls


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_generate_until_is_eval_py_token_for_token(workdir, data, mode):
  _, predictions, eval_calls = eval_py(workdir, data, 4, mode=mode)
  lm = harness.DiffGemmaLM(workdir=workdir, batch_size=4, mode=mode)
  calls = []
  lm._generate_fn = recording(lm._generate_fn, calls)
  requests = [Instance("generate_until", {}, (lm.apply_chat_template(
      [{"role": "user", "content": f"Sort: {w}"}]), {"until": []}), i)
              for i, w in enumerate(WORDS)]
  replies = lm.generate_until(requests, disable_tqdm=True)
  assert len(calls) == len(eval_calls) == 2
  for ours, theirs in zip(calls, eval_calls):
    np.testing.assert_array_equal(ours, theirs)
  assert replies == [p["reply"] for p in predictions]
  # max_gen_toks caps the reply's tokens; `until` cuts before its first match. (The first call's
  # first row is the longest prompt's: batches go longest first, evaluation.generate_in_batches.)
  text = lm.reply(calls[0][0], {})
  assert text in replies
  assert lm.reply_ids(calls[0][0]) == lm.task.reply_ids(calls[0][0])
  assert lm.reply(calls[0][0], {"max_gen_toks": 3}) == lm.tok.decode(
      lm.task.reply_ids(calls[0][0])[:3])
  if len(text) > 2:
    assert lm.reply(calls[0][0], {"until": [text[2:]]}) == text[:2]


@functools.partial(jax.jit, static_argnums=1)
def encoder_logits(params, model_cfg, tokens_1xT):
  """The encoder's next-token logits [1, T, V] of one unpadded sequence."""
  cache = transformer.init_cache(model_cfg, 1, tokens_1xT.shape[1])
  hidden, _ = transformer.encode(params, model_cfg, tokens_1xT, cache)
  return transformer.lm_head(params, hidden, model_cfg)


def reference_logprob(params, model_cfg, seq, n):
  """(sum of log p of seq's last n tokens, all greedy) in float64 from the encoder's logits of
  the whole unpadded sequence (batch 1, every position, no chunking)."""
  logits = np.asarray(encoder_logits(params, model_cfg, np.asarray(seq, np.int32)[None]),
                      np.float64)[0]
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  positions = np.arange(len(seq) - 1 - n, len(seq) - 1)
  targets = np.asarray(seq)[positions + 1]
  return (float(logp[positions, targets].sum()),
          bool(np.all(logits[positions].argmax(-1) == targets)))


@pytest.fixture(scope="module")
def scorer(workdir):
  return harness.DiffGemmaLM(workdir=workdir, batch_size=3, max_length=40)


def test_loglikelihood_is_the_float64_teacher_forced_sum(scorer, monkeypatch):
  lm = scorer
  shared = []  # the groups scored after one encoding of their context
  score_choices = lm.score_choices
  monkeypatch.setattr(lm, "score_choices", lambda groups, disable_tqdm=True: (
      shared.extend(len(conts) for _, conts in groups) or score_choices(groups, disable_tqdm)))
  long_context = ("Sort the letters of this rather long prompt, please: " * 2).rstrip()
  # A shared context (a multiple-choice question's: encoded once, `score_choices`) and
  # contexts of their own (`score_sequences`), one of them longer than max_length.
  pairs = [("Sort: cab", " abc"), ("", "hello there"), (long_context, " abcdef"),
           ("Sort: cab", " bca"), ("Sort: zyx", "xyz"), ("a", "b"), ("Sort: cab", " c")]
  requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
  results = lm.loglikelihood(requests, disable_tqdm=True)
  assert shared == [3]  # "Sort: cab"'s three continuations
  params, cfg = lm.run.params, lm.model_cfg
  for (context, continuation), (logp, greedy) in zip(pairs, results):
    # The ids by hand: BOS, then bytes (lm-eval moves none of these contexts' characters).
    context_ids = [BOS] + byte_ids(context)
    seq = (context_ids + byte_ids(continuation))[-(lm.max_length + 1):]  # left-truncated
    want, want_greedy = reference_logprob(params, cfg, seq, len(byte_ids(continuation)))
    assert logp == pytest.approx(want, abs=ATOL)
    assert greedy == want_greedy
  assert len([BOS] + byte_ids(long_context + " abcdef")) > lm.max_length + 1  # truncated
  # is_greedy True: a continuation of the head's own argmax tokens (ids, past the text path),
  # beside another of the same context (both scored after one encoding of it) and alone.
  context = [BOS] + byte_ids("Sort: cab")
  seq = list(context)
  for _ in range(3):
    seq.append(int(np.argmax(encoder_logits(params, cfg, np.asarray(seq, np.int32)[None])[0, -1])))
  greedy_cont = seq[len(context):]
  other_cont = [(t + 7) % 200 + 5 for t in greedy_cont]
  out = lm._loglikelihood_tokens([(("", ""), context, greedy_cont),
                                  (("", ""), context, other_cont)], disable_tqdm=True)
  out += lm._loglikelihood_tokens([(("", ""), context, greedy_cont)], disable_tqdm=True)
  assert [g for _, g in out] == [True, False, True]
  for (logp, _), cont in zip(out, (greedy_cont, other_cont, greedy_cont)):
    assert logp == pytest.approx(reference_logprob(params, cfg, context + cont, len(cont))[0],
                                 abs=ATOL)


def test_loglikelihood_rolling_is_the_sum_over_windows(scorer):
  lm = scorer
  length = lm.max_length  # 40 predicted tokens per window
  document = "the quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 4 windows
  short = "hello world"
  totals = lm.loglikelihood_rolling(
      [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in
       enumerate((document, short))], disable_tqdm=True)
  # The windows by hand: the first predicts tokens[:40] after BOS; each later one predicts the
  # next (up to) 40 tokens with the 40 tokens before its last target as input.
  tokens = byte_ids(document)
  want = reference_logprob(lm.run.params, lm.model_cfg, [BOS] + tokens[:length], length)[0]
  start = length
  while start < len(tokens):
    end = min(start + length, len(tokens))
    want += reference_logprob(lm.run.params, lm.model_cfg, tokens[end - length - 1:end],
                              end - start)[0]
    start = end
  assert totals[0] == pytest.approx(want, abs=ATOL)
  # A document of one window: the log-likelihood of it after an empty context (BOS).
  (one, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("", short), 0)],
                               disable_tqdm=True)
  assert totals[1] == pytest.approx(one, abs=ATOL)


def simple_evaluate(workdir, task: str, metadata: dict) -> dict:
  """lm-eval's Python API on one of the harness's local tasks, chat template on, samples kept."""
  lm = harness.DiffGemmaLM(workdir=workdir, batch_size=4)
  task_manager = TaskManager(include_path=harness.TASKS_DIR, include_defaults=False,
                             metadata=metadata)
  return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager,
                                 apply_chat_template=True, log_samples=True)


def test_simple_evaluate_accuracy_is_eval_py_metric(workdir, data, tmp_path):
  # References the untrained model gets right for rows 0, 2 and 4 (its own replies) and wrong
  # for the others, so the accuracy is not trivially 0.
  _, predictions, _ = eval_py(workdir, data, 4)
  records = [chat(f"Sort: {w}", (p["reply"].strip() or "x") if i % 2 == 0 else "no such reply")
             for i, (w, p) in enumerate(zip(WORDS, predictions))]
  scored = write_jsonl(tmp_path / "scored.jsonl", records)
  metrics, predictions, _ = eval_py(workdir, scored, 4)
  assert metrics["accuracy"] == pytest.approx(0.5)
  results = simple_evaluate(workdir, "diffgemma_chat", {"chat_data": scored})
  assert results["results"]["diffgemma_chat"]["exact_match,strip"] == metrics["accuracy"]
  samples = sorted(results["samples"]["diffgemma_chat"], key=lambda s: s["doc_id"])
  assert [s["resps"][0][0] for s in samples] == [p["reply"] for p in predictions]


def test_local_multiple_choice_task_runs(workdir, tmp_path):
  user = "Context:\nA study.\n\nQuestion: Does it work?\n\nAnswer with a short explanation."
  path = write_jsonl(tmp_path / "pubmedqa.jsonl", [
      chat(user, f"Because. The answer is {answer}.") for answer in ("yes", "no", "maybe")])
  results = simple_evaluate(workdir, "diffgemma_pubmedqa", {"pubmedqa_data": path})
  samples = sorted(results["samples"]["diffgemma_pubmedqa"], key=lambda s: s["doc_id"])
  scores = [[r[0][0] for r in s["resps"]] for s in samples]
  # The same prompt for every row: the same three scores, the right answer once each.
  np.testing.assert_allclose(scores, [scores[0]] * 3, atol=ATOL)
  assert results["results"]["diffgemma_pubmedqa"]["acc,none"] == pytest.approx(1 / 3)
  assert [s["target"] for s in samples] == [0, 1, 2]


def test_errors_are_one_line(workdir, tmp_path, monkeypatch, capfd):
  with pytest.raises(errors.ConfigError, match="unknown --model_args key 'entropy_bond'"):
    harness.DiffGemmaLM(workdir=workdir, entropy_bond=0.2)
  with pytest.raises(errors.ConfigError, match="is not a float"):
    harness.DiffGemmaLM(workdir=workdir, entropy_bound="high")
  with pytest.raises(errors.ConfigError, match="workdir=DIR"):
    harness.DiffGemmaLM()
  multi = write_jsonl(tmp_path / "multi.jsonl", [{"messages": [
      {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
      {"role": "assistant", "content": "a"}]}])
  with pytest.raises(errors.InputError, match="multi.jsonl:1: the harness tasks take one user"):
    harness.chat_docs(multi)
  with pytest.raises(errors.InputError, match="--metadata chat_data=FILE"):
    harness.chat_dataset()
  # The command line: lm-eval's, the model registered; our errors one line (exit code 2).
  # In-process, lm-eval's index of its own tasks left out (it takes seconds).
  monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                      functools.partial(TaskManager, include_defaults=False))
  monkeypatch.setattr(sys, "argv", list(sys.argv))
  monkeypatch.setenv("DIFFGEMMA_LIBRARY_LOGS", "1")  # cli.run leaves the process's logging be
  with pytest.raises(SystemExit) as exit_info:
    harness.main(["--model", "diffgemma", "--model_args",
                  "workdir=" + os.path.join(str(tmp_path), "missing"), "--tasks",
                  "diffgemma_chat"])
  assert exit_info.value.code == 2
  lines = [l for l in capfd.readouterr().err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "no training run" in lines[0], lines
  assert harness.harness_argv(["--tasks", "t"]) == ["--tasks", "t", "--include_path",
                                                    harness.TASKS_DIR]
  assert harness.harness_argv(["--include_path", "x"]) == ["--include_path", "x"]


def test_thinking_prompts_and_the_answer_after_the_thought(workdir):
  """In the run's thinking mode (data.thinking) the chat template opens with <|think|>; a
  reply is the answer after its thought, as eval.py scores it, before the `until` cut."""
  lm = harness.DiffGemmaLM(workdir=workdir, batch_size=4)
  tok = lm.tok
  ids = tok.encode("<|channel>thought\nab<channel|>xyz") + [tok.eot_id]
  row = np.concatenate([ids, np.full(48 - len(ids), tok.pad_id)]).astype(np.int32)
  assert lm.reply(row, {}) == "xyz" and lm.reply(row, {"until": ["z"]}) == "xy"
  assert lm.reply(row, {"max_gen_toks": 12}) == ""  # cut inside the thought: no answer
  turn = [{"role": "user", "content": "hi"}]
  assert "<|think|>" not in lm.apply_chat_template(turn)
  lm.task.settings = dataclasses.replace(lm.task.settings, thinking=True)
  assert lm.apply_chat_template(turn).startswith("<bos><|turn>system\n<|think|>\n<turn|>\n")


def test_module_command_answers_help():
  result = run("-m", "diffgemma.harness", "--help")
  assert result.returncode == 0, result.stderr
  assert "--model_args" in result.stdout and "workdir=DIR" in result.stdout
