r"""An lm-evaluation-harness model (`lm-eval` 0.4.x on PyPI) for diffgemma runs and checkpoints.

  pip install ".[eval]"                   # or: pip install -r requirements-eval.txt
  python -m diffgemma.harness --model diffgemma --model_args workdir=runs/chat/sort \
      --tasks diffgemma_chat --metadata chat_data=/tmp/sort_test.jsonl --apply_chat_template

The model is registered under the name `diffgemma` when this module is imported. lm-eval 0.4
has no plugin entry point for models, so the plain `lm_eval` command cannot find it by itself:
`python -m diffgemma.harness ARGS` (or the `diffgemma-lm-eval` script that `pip install .`
adds) imports the registration, adds `--include_path` for the local tasks of
diffgemma/harness_tasks/ (unless ARGS give one), and runs lm-eval's own command line with
ARGS. From Python, `import diffgemma.harness` before `lm_eval.simple_evaluate(model="diffgemma",
...)`, or pass a `DiffGemmaLM` instance. docs/evaluation.md says when to use this and when
eval.py.

`--model_args` (comma-separated KEY=VALUE):
  workdir=DIR                a training run (its latest checkpoint, task and sampler), or
  init_from=DIR [config=NAME[:ARG] or a path]   a model checkpoint under a config's task
                             and sampler settings, as eval.py --init_from (default: sft_chat
                             with the checkpoint's own tokenizer).
  quantize=int8|int4         weight-only quantization before evaluating (eval.py --quantize).
  max_length=N               the context window, in tokens: log-likelihood windows and the room
                             for generation prompts (prompt slots = max_length - the reply's
                             K*C slots). Default: the run's training sequence, P + K*C.
  seed=N                     the sampler's seed (eval.py --seed).
  any SamplerConfig field    e.g. entropy_bound=0.2, mode=ar, max_denoising_steps=32
                             (diffgemma/sampling/sampler.py; eval.py's --sampler.KEY=VALUE).
The harness's --batch_size is the sampler's and the scorer's batch ("auto": the run's
eval.batch_size).

The three requests:
  generate_until         prompts (chat-templated when the harness asks, --apply_chat_template
                         and --system_instruction, in the run's thinking mode, data.thinking;
                         else BOS and the plain text) left-padded to
                         the run's prompt slots and decoded by the run's sampler in batches of
                         --batch_size, in request order: `evaluation.generate_in_batches`, the
                         loop eval.py runs, so the same data, batch and seed give eval.py's
                         tokens. The reply is cut at its first stop id (as eval.py), then at
                         `max_gen_toks` tokens, then to the answer after its thought (as
                         eval.py scores it), then before the first `until` string. The
                         sampler's budget (max_new_tokens) is fixed when it compiles: a larger
                         max_gen_toks is warned about once and cannot lengthen a reply. Other
                         generation kwargs (temperature, do_sample) are not used: the sampler's
                         settings decide.
  loglikelihood          exact: a causal encoder pass over context + continuation (batched)
                         and the encoder's next-token head, the pair `transformer.encode` /
                         `transformer.lm_head` that mode="ar" decodes with; the sum of the
                         continuation's token log-probabilities and whether each is the
                         argmax. A context shared by several continuations (a multiple-choice
                         question's choices) is encoded once and each continuation after it
                         (`choice_scores`). A context longer than max_length loses its oldest
                         tokens; the continuation is kept whole.
  loglikelihood_rolling  a document in disjoint windows of max_length predicted tokens after a
                         BOS (lm_eval.utils.get_rolling_token_windows), the windows' sums added.

Local task data (diffgemma/harness_tasks/*.yaml) is read from the file that `--metadata
KEY=FILE` names (KEY: chat_data or pubmedqa_data; or the environment variable DIFFGEMMA_KEY in
upper case), by `chat_dataset` / `pubmedqa_dataset` below.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys

from diffgemma import errors

LM_EVAL_MISSING = ("the harness needs lm-eval 0.4: pip install \".[eval]\" (or "
                   "pip install -r requirements-eval.txt)")
try:
  import lm_eval.models  # noqa: F401  (lm-eval's own models stay findable after ours)
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
except ImportError as e:
  if __name__ == "__main__":
    errors.print_error(LM_EVAL_MISSING)
    sys.exit(2)
  raise ImportError(LM_EVAL_MISSING) from e

if __name__ == "__main__":
  # Run as `python -m diffgemma.harness`, this file is __main__: the model registers once, from
  # the module diffgemma.harness (its tasks' data loaders import that module too).
  import importlib

  importlib.import_module("diffgemma.harness").main()
  sys.exit(0)

import chex
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from diffgemma.model import transformer
from diffgemma.model.config import ModelConfig

MODEL_NAME = "diffgemma"
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness_tasks")
DEFAULT_CONFIG = "sft_chat"
# Model arguments that are not sampler fields (batch_size, max_batch_size and device come from
# the harness's own options).
RUN_ARGS = ("workdir", "init_from", "config", "quantize", "max_length", "seed")
# Generation kwargs the harness honours; the rest are the sampler's business.
GEN_KWARGS = ("until", "max_gen_toks")
# Continuation positions scored per lm_head call (bounds the [B, chunk, V] logits).
SCORE_CHUNK = 256

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- scoring


@functools.partial(jax.jit, static_argnums=(1, 5))
def token_scores(params, model_cfg: ModelConfig, tokens_BxT, valid_BxT, first_B,
                 num_scored: int):
  """Teacher-forced scores of tokens first_B + 1 .. first_B + num_scored of each row: the
  log-probability the encoder's next-token head gives each (float32 [B, M]) and whether it is
  the head's argmax (bool [B, M]), M = num_scored.

  One causal encoder pass over the right-padded rows (`transformer.encode`, padding never
  attended, positions from 0), then `transformer.lm_head` on the scored positions only,
  SCORE_CHUNK at a time.
  Positions past a row's end are clamped (their scores are garbage for the caller to drop).
  """
  b, t = tokens_BxT.shape
  cache = transformer.init_cache(model_cfg, b, t)
  hidden_BxTxD, _ = transformer.encode(params, model_cfg, tokens_BxT, cache, valid_BxT)
  pos_BxM = jnp.minimum(first_B[:, None] + jnp.arange(num_scored), t - 2)
  chunk = min(num_scored, SCORE_CHUNK)

  def score(pos_BxK):
    h_BxKxD = jnp.take_along_axis(hidden_BxTxD, pos_BxK[..., None], axis=1)
    logits_BxKxV = transformer.lm_head(params, h_BxKxD, model_cfg)
    target_BxK = jnp.take_along_axis(tokens_BxT, pos_BxK + 1, axis=1)
    logp_BxKxV = jax.nn.log_softmax(logits_BxKxV, axis=-1)
    logp_BxK = jnp.take_along_axis(logp_BxKxV, target_BxK[..., None], axis=-1)[..., 0]
    return logp_BxK, jnp.argmax(logits_BxKxV, axis=-1) == target_BxK

  if chunk == num_scored:
    return score(pos_BxM)
  pos_NxBxK = pos_BxM.reshape(b, num_scored // chunk, chunk).transpose(1, 0, 2)
  logp_NxBxK, greedy_NxBxK = jax.lax.map(score, pos_NxBxK)
  return (logp_NxBxK.transpose(1, 0, 2).reshape(b, num_scored),
          greedy_NxBxK.transpose(1, 0, 2).reshape(b, num_scored))


@functools.partial(jax.jit, static_argnums=1)
def choice_scores(params, model_cfg: ModelConfig, context_BxT, context_valid_BxT,
                  choices_BxCxM, choices_valid_BxCxM):
  """`token_scores` of C continuations of each row's context, the context encoded once: its
  causal pass fills a cache, each continuation is encoded after it, and the next-token head
  scores the continuation's tokens (the first from the context's last position). Contexts are
  left-padded and continuations right-padded, so every row's tokens sit at consecutive
  positions (RoPE sees the distances of the unpadded sequence). Returns log-probabilities
  float32 [B, C, M] and argmax matches bool [B, C, M]; padding slots hold garbage."""
  b, t = context_BxT.shape
  m = choices_BxCxM.shape[2]
  cache = transformer.init_cache(model_cfg, b, t + m)
  hidden_BxTxD, cache = transformer.encode(params, model_cfg, context_BxT, cache, context_valid_BxT)

  def score(args):
    choice_BxM, valid_BxM = args
    hidden_BxMxD, _ = transformer.encode(params, model_cfg, choice_BxM, cache, valid_BxM)
    h_BxMxD = jnp.concatenate([hidden_BxTxD[:, -1:], hidden_BxMxD[:, :-1]], axis=1)
    logits_BxMxV = transformer.lm_head(params, h_BxMxD, model_cfg)
    logp_BxMxV = jax.nn.log_softmax(logits_BxMxV, axis=-1)
    logp_BxM = jnp.take_along_axis(logp_BxMxV, choice_BxM[..., None], axis=-1)[..., 0]
    return logp_BxM, jnp.argmax(logits_BxMxV, axis=-1) == choice_BxM

  logp_CxBxM, greedy_CxBxM = jax.lax.map(score, (choices_BxCxM.transpose(1, 0, 2),
                                                 choices_valid_BxCxM.transpose(1, 0, 2)))
  return logp_CxBxM.transpose(1, 0, 2), greedy_CxBxM.transpose(1, 0, 2)


def bucket(n: int, cap: int | None = None) -> int:
  """A padded length for n: the next of 16, 32, 64, 128, 256, then multiples of 128 (few
  compiled shapes), at most `cap`."""
  size = 16
  while size < n and size < 256:
    size *= 2
  if size < n:
    size = -(-n // 128) * 128
  return size if cap is None else max(n, min(size, cap))


# ----------------------------------------------------------------------------- the model


def _config(spec: str):
  """The ConfigDict of `config=` (NAME[:ARG] of configs/, or a path[:ARG]), as --config."""
  from diffgemma import cli

  name, sep, arg = str(spec).partition(":")
  if not name.endswith(".py") and os.sep not in name:
    name = os.path.join(cli.CONFIG_DIR, name + ".py")
  if not os.path.isfile(name):
    raise errors.ConfigError(f"config={spec!r}: no such config file ({name})")
  try:
    return cli.parse_config(name + (sep + arg if sep else ""), [])
  except cli.UserError as e:
    raise errors.ConfigError(f"config={spec!r}: {e}") from None


def _checkpoint_config(spec: str | None):
  """The config of an init_from= checkpoint: `config=`, else sft_chat with the checkpoint's own
  tokenizer (data.tokenizer cleared; the architecture always comes from the checkpoint)."""
  if spec is not None:
    return _config(spec)
  config = _config(DEFAULT_CONFIG)
  config.data.tokenizer = ""
  return config


def _batch_size(value, default: int) -> int:
  if value is None or (isinstance(value, str) and value.startswith("auto")):
    return default
  try:
    size = int(value)
  except (TypeError, ValueError):
    raise errors.ConfigError(f"batch_size={value!r} is not a number or 'auto'") from None
  if size <= 0:
    raise errors.ConfigError(f"batch_size must be positive, got {size}")
  return size


def encode_with_specials(tok, text: str) -> list[int]:
  """Ids of `text` with special-token strings in it (<bos>, turn markers) as their ids: how
  the tokenizer reads a rendered chat template (`Tokenizer.render`), so a templated prompt
  gets exactly the ids eval.py gives it."""
  encode = getattr(getattr(tok, "_backend", None), "encode_with_specials", None)
  return list(encode(text) if encode is not None else tok.encode(text))


@register_model(MODEL_NAME)
class DiffGemmaLM(TemplateLM):
  """A diffgemma run (or checkpoint) as an lm-eval model; the module docstring has the
  arguments and what each request does."""

  def __init__(self, workdir: str | None = None, init_from: str | None = None,
               config: str | None = None, quantize: str | None = None,
               max_length: int | None = None, seed: int = 0, batch_size=1,
               max_batch_size=None, device=None, **sampler_args):
    super().__init__()
    del max_batch_size, device  # JAX places the work; one batch size
    from diffgemma import cli
    from diffgemma.training import loaded
    from diffgemma.sampling import sampler

    if workdir and init_from:
      raise errors.ConfigError("give one of workdir= or init_from= in --model_args, not both")
    if not (workdir or init_from):
      raise errors.ConfigError("--model_args needs workdir=DIR (a training run) or "
                               "init_from=DIR (a checkpoint)")
    if config is not None and workdir:
      raise errors.ConfigError("config= goes with init_from=; a workdir has its own config")
    fields = {f.name for f in dataclasses.fields(sampler.SamplerConfig)}
    unknown = sorted(set(sampler_args) - fields)
    if unknown:
      raise errors.ConfigError(
          f"unknown --model_args key {unknown[0]!r}; choose one of {RUN_ARGS} or a sampler "
          f"field {tuple(sorted(fields))}")
    try:
      overrides = cli.typed_overrides({k: _override_text(v) for k, v in sampler_args.items()},
                                      sampler.SamplerConfig, "sampler")
    except ValueError as e:
      raise errors.ConfigError(str(e).replace("--sampler.", "--model_args ")) from None
    if quantize not in (None, "int8", "int4"):
      raise errors.ConfigError(f"quantize={quantize!r}: choose int8 or int4")
    if workdir:
      run = loaded.open_run(str(workdir), **overrides)
    else:
      run = loaded.open_checkpoint(str(init_from), _checkpoint_config(config), **overrides)
    if not hasattr(run.task, "tokenizer") or not hasattr(run.task, "reply_ids"):
      raise errors.ConfigError(f"{run.source}: the harness evaluates text models; this run's "
                               f"task is {run.task.name!r} (use eval.py)")
    if run.untrained_ar_head():
      logger.warning(run.untrained_ar_head())
    self.run = run.load()
    if quantize:
      from diffgemma.model import quantize as quantize_lib

      self.run.params = quantize_lib.quantize_params(self.run.params,
                                                     quantize_lib.QuantizeConfig(quantize))
    self.task = self.run.task
    self.tok = self.task.tokenizer
    self.tokenizer = self.tok  # TemplateLM reads it (chat_template)
    self.model_cfg: ModelConfig = self.run.model_cfg
    self.sampler_cfg = self.run.sampler_cfg
    self.sampler_overrides = overrides
    self.batch_size = _batch_size(batch_size, self.run.run_cfg.eval.batch_size)
    self.seed = int(seed)
    layout = self.task.layout
    self.reply_slots = sampler.num_canvases(self.model_cfg, self.sampler_cfg) * \
        self.model_cfg.canvas_length
    self._max_length = int(max_length) if max_length is not None else layout.seq_len
    if self._max_length < 2:
      raise errors.ConfigError(f"max_length must be at least 2, got {self._max_length}")
    self._generate_fn = sampler.make_generate_fn(self.model_cfg, self.sampler_cfg)
    self._warned: set = set()

  # ---------------------------------------------------------------- what lm-eval reads

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context (and every rolling window's first token) conditions on: BOS,
    which every training sequence starts with."""
    return self.tok.bos_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def tokenizer_name(self) -> str:
    return str(self.tok.directory).replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.tok.chat_template if chat_template not in (False, None) else None

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The chat template's text (BOS and turn markers as strings; `tok_encode` reads them
    back as their ids, as `Tokenizer.render` does)."""
    return self.tok.render_text(chat_history, add_generation_prompt=add_generation_prompt,
                                enable_thinking=self.task.settings.thinking)

  def get_model_info(self) -> dict:
    return {"diffgemma_source": self.run.source, "diffgemma_step": self.run.step,
            "diffgemma_sampler": dataclasses.asdict(self.sampler_cfg),
            "diffgemma_max_length": self._max_length}

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                 ) -> list[int]:
    """Ids of `string` (special-token strings as their ids); BOS first unless
    `add_special_tokens` is False or the string already starts with it (a rendered chat)."""
    del kwargs
    ids = encode_with_specials(self.tok, string)
    if add_special_tokens is False or (ids and ids[0] == self.tok.bos_id):
      return ids
    return [self.tok.bos_id] + ids

  def _warn_once(self, key, message: str) -> None:
    if key not in self._warned:
      self._warned.add(key)
      logger.warning(message)

  # ---------------------------------------------------------------- log-likelihoods

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                            ) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether every continuation token is the
    argmax) per ((context, continuation), context_ids, continuation_ids), in request order."""
    del kwargs
    groups: dict[tuple, list[int]] = {}  # context ids -> requests that continue it
    for i, (_, context_ids, continuation_ids) in enumerate(requests):
      n = len(continuation_ids)
      if n > self._max_length:
        raise errors.InputError(f"request {i}: a continuation of {n} tokens does not fit "
                                f"max_length={self._max_length}; raise it in --model_args")
      groups.setdefault(tuple(context_ids), []).append(i)
    # A context shared by several continuations that all fit untruncated (a multiple-choice
    # question's choices) is encoded once (`score_choices`); every other request on its own.
    shared, single = [], []
    for context, members in groups.items():
      fits = all(1 <= len(requests[i][2]) <= SCORE_CHUNK
                 and len(context) + len(requests[i][2]) <= self._max_length + 1
                 for i in members)
      if len(members) > 1 and context and fits:
        shared.append((list(context), [list(requests[i][2]) for i in members], members))
      else:
        single += members
    results: list = [None] * len(requests)
    for members, out in zip([m for _, _, m in shared],
                            self.score_choices([(c, conts) for c, conts, _ in shared],
                                               disable_tqdm)):
      for i, result in zip(members, out):
        results[i] = result
    rows = [((list(requests[i][1]) + list(requests[i][2]))[-(self._max_length + 1):],
             len(requests[i][2])) for i in single]
    for i, result in zip(single, self.score_sequences(rows, disable_tqdm)):
      results[i] = result
    for (pair, _, _), result in zip(requests, results):
      self.cache_hook.add_partial("loglikelihood", pair, result)
    return results

  def score_sequences(self, rows, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
    """[(sum of the log-probabilities of the last n tokens of seq given the tokens before
    them, whether each of them is the argmax)] for rows [(seq ids, n)], 1 <= n < len(seq);
    batched by length (longest first), the sums in float64."""
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    batch = min(self.batch_size, max(len(rows), 1))
    with tqdm(total=len(rows), desc="loglikelihood", disable=disable_tqdm) as bar:
      for start in range(0, len(order), batch):
        index = order[start:start + batch]
        index = index + [index[0]] * (batch - len(index))  # one compiled batch shape
        t = bucket(max(len(rows[i][0]) for i in index), self._max_length + 1)
        m = bucket(max(rows[i][1] for i in index))
        if m > SCORE_CHUNK:
          m = -(-m // SCORE_CHUNK) * SCORE_CHUNK
        tokens_BxT = np.full((batch, t), self.tok.pad_id, np.int32)
        valid_BxT = np.zeros((batch, t), bool)
        first_B = np.zeros(batch, np.int32)
        for r, i in enumerate(index):
          seq, n = rows[i]
          tokens_BxT[r, :len(seq)], valid_BxT[r, :len(seq)] = seq, True
          first_B[r] = len(seq) - 1 - n
        logp_BxM, greedy_BxM = jax.tree_util.tree_map(np.asarray, token_scores(
            self.run.params, self.model_cfg, tokens_BxT, valid_BxT, first_B, m))
        chex.assert_shape([logp_BxM, greedy_BxM], (batch, m))
        chex.assert_type(logp_BxM, np.float32)
        for r, i in enumerate(index[:min(batch, len(order) - start)]):
          n = rows[i][1]
          out[i] = (float(np.sum(logp_BxM[r, :n], dtype=np.float64)),
                    bool(np.all(greedy_BxM[r, :n])))
        bar.update(min(batch, len(order) - start))
    return out

  def score_choices(self, groups, disable_tqdm: bool = True) -> list[list[tuple[float, bool]]]:
    """`score_sequences` of several continuations of one context, per group
    [(context ids, [continuation ids, ...])], the context encoded once per group
    (`choice_scores`); batches of --batch_size groups, longest context first."""
    out: list = [None] * len(groups)
    order = sorted(range(len(groups)), key=lambda g: -len(groups[g][0]))
    batch = min(self.batch_size, max(len(groups), 1))
    with tqdm(total=len(groups), desc="loglikelihood (shared contexts)",
              disable=disable_tqdm) as bar:
      for start in range(0, len(order), batch):
        index = order[start:start + batch]
        real = len(index)
        index = index + [index[0]] * (batch - real)
        t = bucket(max(len(groups[g][0]) for g in index))
        m = bucket(max(len(c) for g in index for c in groups[g][1]))
        c = max(len(groups[g][1]) for g in index)
        context_BxT = np.full((batch, t), self.tok.pad_id, np.int32)
        context_valid_BxT = np.zeros((batch, t), bool)
        choices_BxCxM = np.full((batch, c, m), self.tok.pad_id, np.int32)
        choices_valid_BxCxM = np.zeros((batch, c, m), bool)
        for r, g in enumerate(index):
          context, continuations = groups[g]
          context_BxT[r, t - len(context):], context_valid_BxT[r, t - len(context):] = (
              context, True)
          for k, cont in enumerate(continuations):
            choices_BxCxM[r, k, :len(cont)], choices_valid_BxCxM[r, k, :len(cont)] = cont, True
        logp_BxCxM, greedy_BxCxM = jax.tree_util.tree_map(np.asarray, choice_scores(
            self.run.params, self.model_cfg, context_BxT, context_valid_BxT, choices_BxCxM,
            choices_valid_BxCxM))
        chex.assert_shape([logp_BxCxM, greedy_BxCxM], (batch, c, m))
        chex.assert_type(logp_BxCxM, np.float32)
        for r, g in enumerate(index[:real]):
          out[g] = [(float(np.sum(logp_BxCxM[r, k, :len(cont)], dtype=np.float64)),
                     bool(np.all(greedy_BxCxM[r, k, :len(cont)])))
                    for k, cont in enumerate(groups[g][1])]
        bar.update(real)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each document's log-likelihood after a BOS, in disjoint windows of at most max_length
    predicted tokens, each with as much context as fits (lm-eval's rolling windows)."""
    rows, owner = [], []
    for d, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                       lm_eval_utils.get_rolling_token_windows(
                                           token_list=self.tok_encode(string,
                                                                      add_special_tokens=False),
                                           prefix_token=self.prefix_token_id,
                                           max_seq_len=self._max_length, context_len=1)):
        rows.append((list(context) + list(continuation), len(continuation)))
        owner.append(d)
    totals = [0.0] * len(requests)
    for d, (logp, _) in zip(owner, self.score_sequences(rows, disable_tqdm)):
      totals[d] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # ---------------------------------------------------------------- generation

  def prompt_slots(self, longest: int) -> int:
    """Prompt slots of a generate_until call: the run's P (what eval.py pads to) while every
    prompt fits it, else room for the longest prompt (a bucketed length), at most
    max_length - K*C."""
    p = self.task.layout.prompt_len
    if longest <= p:
      return p
    return max(p, min(bucket(longest), self._max_length - self.reply_slots))

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    from diffgemma.training import evaluation
    from diffgemma.tasks import chat_data
    from diffgemma.tasks.base import Prompts

    if not requests:
      return []
    contexts = [req.args[0] for req in requests]
    gen_kwargs = [dict(req.args[1] or {}) for req in requests]
    ids = [self.tok_encode(c) for c in contexts]
    slots = self.prompt_slots(max(len(x) for x in ids))
    counts = chat_data.OverflowCounts()
    rows = [chat_data.left_pad(chat_data.fit_prompt(x, slots, self.tok.bos_id, "truncate_left",
                                                    "", counts), slots, self.tok.pad_id)
            for x in ids]
    if counts.prompt_truncated:
      self._warn_once(("truncated", slots), (
          f"{counts.prompt_truncated} of {len(ids)} prompts are longer than {slots} prompt slots "
          f"and lost their oldest tokens (BOS kept); raise max_length (now {self._max_length}) "
          f"in --model_args for more"))
    for kw in gen_kwargs:
      ignored = sorted(set(kw) - set(GEN_KWARGS))
      if ignored:
        self._warn_once(("ignored", tuple(ignored)), (
            f"generation kwargs {ignored} are not used: the sampler's settings decide "
            f"({'ar' if self.sampler_cfg.mode == 'ar' else 'diffusion'} mode; set sampler "
            "fields in --model_args)"))
      cap = kw.get("max_gen_toks")
      if cap is not None and int(cap) > self.sampler_cfg.max_new_tokens:
        self._warn_once(("max_gen_toks", int(cap)), (
            f"max_gen_toks={int(cap)} is more than the sampler's budget max_new_tokens="
            f"{self.sampler_cfg.max_new_tokens}: replies stop there (pass max_new_tokens="
            f"{int(cap)} in --model_args for longer ones)"))
    prompts = Prompts(np.stack([t for t, _ in rows]), np.stack([v for _, v in rows]),
                      [None] * len(rows))
    with tqdm(total=len(rows), desc="generate_until", disable=disable_tqdm) as bar:
      tokens_NxL, _, _ = evaluation.generate_in_batches(
          self.run.params, self._generate_fn, prompts, self.batch_size, self.seed, bar)
    out = []
    for req, kw, row in zip(requests, gen_kwargs, tokens_NxL):
      text = self.reply(row, kw)
      self.cache_hook.add_partial("generate_until", req.args, text)
      out.append(text)
    return out

  def reply_ids(self, tokens_L) -> list[int]:
    """The ids of a generated row (K*C slots) before its first stop id, pads dropped: the
    chat task's `reply_ids`, without its cut of a whole training sequence (a max_new_tokens
    override can make K*C equal P + the run's K*C)."""
    stops, pad, out = set(self.task.stop_token_ids), self.tok.pad_id, []
    for t in np.asarray(tokens_L).reshape(-1).tolist():
      if t in stops:
        break
      if t != pad:
        out.append(t)
    return out

  def reply(self, tokens_L, gen_kwargs: dict) -> str:
    """A generated row's text: up to the first stop id (the task's cut, as eval.py), at most
    max_gen_toks tokens, the answer after its thought (the task's `split_reply_ids`), then cut
    before the first of the `until` strings."""
    ids = self.reply_ids(tokens_L)
    cap = gen_kwargs.get("max_gen_toks")
    if cap is not None:
      ids = ids[:max(int(cap), 0)]
    _, text = self.task.split_reply_ids(ids)
    until = gen_kwargs.get("until") or []
    for stop in [until] if isinstance(until, str) else until:
      if stop:
        text = text.split(stop)[0]
    return text


def _override_text(value) -> str:
  """A --model_args value (lm-eval has typed it: 0.2, True, None) back to the text
  `cli.typed_overrides` reads; a tuple field's ids may be separated by ';' or spaces (','
  separates the arguments)."""
  if isinstance(value, bool):
    return str(value).lower()
  return str(value).replace(";", ",").replace(" ", ",") if isinstance(value, str) else str(value)


# ----------------------------------------------------------------------------- local task data


def _data_path(data_key: str, metadata: dict) -> str:
  env = "DIFFGEMMA_" + data_key.upper()
  path = metadata.get(data_key) or os.environ.get(env)
  if not path:
    raise errors.InputError(f"no data for this task: pass --metadata {data_key}=FILE.jsonl "
                            f"(or set {env}=FILE.jsonl)")
  path = os.path.expanduser(str(path))
  if not os.path.isfile(path):
    raise errors.InputError(f"{data_key}={path!r}: no such file")
  return path


def chat_docs(path: str, limit: int | None = None) -> list[dict]:
  """The documents of a chat JSONL (diffgemma/tasks/chat_data.py's formats): prompt (the user
  turn), reference (the reply), source (file:line). One user turn then the reply, as
  scripts/make_chat_task.py and scripts/convert_pubmedqa.py write them; longer conversations
  and infill records are eval.py's (InputError, one line)."""
  from diffgemma.tasks import chat_data

  docs = []
  for conversation in chat_data.read_jsonl(path):
    roles = [m["role"] for m in conversation.messages]
    if roles != ["user", "assistant"] or conversation.infill is not None:
      raise errors.InputError(f"{conversation.source}: the harness tasks take one user turn "
                              "then the reply (this record has "
                              f"{'an infill split' if conversation.infill else roles}); "
                              "evaluate it with eval.py")
    if conversation.images:
      raise errors.InputError(f"{conversation.source}: the harness tasks take text only; "
                              "evaluate image prompts with eval.py")
    docs.append({"prompt": chat_data.message_text(conversation.messages[0]),
                 "reference": chat_data.message_text(conversation.messages[1]),
                 "source": conversation.source})
    if limit is not None and len(docs) >= limit:
      break
  return docs


def _dataset(docs: list[dict]):
  import datasets

  return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def chat_dataset(data_key: str = "chat_data", **metadata):
  """The local generation task's data (harness_tasks/diffgemma_chat.yaml's custom_dataset):
  the chat JSONL `--metadata chat_data=FILE` names."""
  return _dataset(chat_docs(_data_path(data_key, metadata)))


def pubmedqa_docs(path: str) -> list[dict]:
  """chat_docs of a scripts/convert_pubmedqa.py file, with the reference's decision: answer
  (yes / no / maybe, eval.py's choice metric's reading) and label (its index in CHOICES)."""
  from diffgemma.tasks import text_metrics

  docs = chat_docs(path)
  for doc in docs:
    answer = text_metrics.reference_answer("choice", doc["reference"])
    if answer is None:
      raise errors.InputError(f"{doc['source']}: the reply has no \"The answer is "
                              "yes|no|maybe\" marker (scripts/convert_pubmedqa.py's format)")
    doc.update(answer=answer, label=text_metrics.CHOICES.index(answer))
  return docs


def pubmedqa_dataset(data_key: str = "pubmedqa_data", **metadata):
  """The local PubMedQA-format tasks' data (harness_tasks/diffgemma_pubmedqa*.yaml)."""
  return _dataset(pubmedqa_docs(_data_path(data_key, metadata)))


# ----------------------------------------------------------------------------- command line


def harness_argv(args: list[str]) -> list[str]:
  """lm-eval's command line for ours: the local tasks' directory added as --include_path
  unless one is given (lm-eval takes one), and unless only help is asked for."""
  if not args or "-h" in args or "--help" in args:
    return args
  if any(a == "--include_path" or a.startswith("--include_path=") for a in args):
    return args
  return args + ["--include_path", TASKS_DIR]


def main(argv: list[str] | None = None) -> None:
  """`python -m diffgemma.harness ARGS`: lm-eval's command line with the diffgemma model
  registered; our errors are one line (exit code 2)."""
  from diffgemma import cli
  from lm_eval.__main__ import cli_evaluate

  args = list(sys.argv[1:] if argv is None else argv)
  if args in (["-h"], ["--help"]):  # ours, then the options of lm-eval's `run`
    print(__doc__.split("\nThe three requests:")[0].rstrip() + "\n\nlm-eval's options:\n")
    args = ["run", "--help"]
  sys.argv = ["lm-eval"] + harness_argv(args)
  cli.run(lambda _: cli_evaluate(), argv=[sys.argv[0]])
