"""The chat task: SFT on JSONL conversations, text evaluation, SD·RL prompts and rewards.

Built by `diffgemma.tasks.make_task` when `config.task.name == "chat"`. Every key it reads is
documented at `ChatSettings` (sections data, eval, and rl.reward / rl.reward_fn).
`from_config` loads the tokenizer, reads and checks every data file and lays the examples out,
so a bad line or an overflow under `data.overflow="error"` fails before a run writes anything.
Data formats, the canvas layout and the overflow policies: diffgemma/tasks/chat_data.py;
metrics: diffgemma/tasks/text_metrics.py.

Infill data (records with an "infill" split of the reply, chat_data's module docstring;
scripts/make_chat_task.py --task=infill_count): evaluation hands the sampler the reply's prefix
and suffix as fixed tokens (`infill_slots`, the path sample.py --infill_* takes), the middle as
many slots as the reference middle's tokens, and scores infill_accuracy (the headline on such
data): the generated middle's text equals the reference middle exactly.

The tokenizer (`data.tokenizer`): a directory holding tokenizer.json or tokenizer.model plus a
chat template; "bytes" (diffgemma/io/tokenizer.py's byte-level tokenizer; "bytes_image" with
image tokens); empty = the run's `init_from` checkpoint directory.

Images (user turns' image parts, chat_data's module docstring): the prompt is rendered and its
image tokens expanded to each image's placeholder as transformers' Gemma 4 processor does
(`Tokenizer.render(..., image_soft_tokens)`), and the images go beside the tokens as the vision
tower takes them (diffgemma/io/image_processing.py): training batches add pixel_values and
image_position_ids for data.max_images image slots, held-out `Prompts` their
pixel_values_NxIxMxD / image_positions_NxIxMx2. The image processor's sizes (`image_settings`):
the source checkpoint's processor_config.json, else the model's vision config (patch_size,
pooling_kernel_size, default_output_length), data.max_soft_tokens overriding the budget. Every
image is decoded when the task is built, so a missing, unreadable or oversized image, an image
for a model without a vision tower (`chat_data.check_images`), or one more than the layout
holds fails in one line naming its file and line before a run writes anything.

Thinking (`data.thinking`; sample.py --thinking): prompts are rendered in the template's
thinking mode (`enable_thinking`); an assistant turn's thought (chat_data's module docstring)
trains in the template's thinking channel before the answer, and evaluation, rewards and
sample.py cut a generated reply into its thought and the answer after it (`split_reply`): only
the answer is scored, so a thought that holds the right answer does not count.

A user reward function (`rl.reward_fn="package.module:function"`) is called as
`function(prompt, reply, reference) -> float` with the last user turn's text, the generated
reply's answer (up to its first stop token, after its thought) and the reference reply; the
value is clipped to [0, 1], and a row is "correct" when it scores 1.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from diffgemma import errors
from diffgemma.io import image_processing, model_dirs
from diffgemma.io import tokenizer as tokenizer_lib
from diffgemma.runs import checkpointing
from diffgemma.sampling import sampler
from diffgemma.tasks import chat_data, packing, text_metrics
from diffgemma.tasks.base import ImageSlots, Layout, PackedLayout, Prompts, RlTask

DEFAULT_REWARD = "exact"
INFILL_METRIC = "infill_accuracy"  # the headline on infill data
# Seed streams of the two index orders drawn from the training split.
_TRAIN_STREAM, _ROLLOUT_STREAM = 1, 2
NO_TRAINING_DATA = "no training data: set data.train (e.g. --config.data.train=FILE.jsonl)"


@dataclasses.dataclass(frozen=True)
class ChatSettings:
  """The chat task's config keys, checked. Data formats, layout and overflow policies are
  described in diffgemma/tasks/chat_data.py.

    task.name            "chat".
    data.train           training JSONL: a path, comma-separated paths, or a list of paths. Each
                         line is {"messages": [...]}, {"prompt", "completion"} or ShareGPT
                         {"conversations": [...]}; one example per assistant turn.
    data.weights         mixing weights, one per data.train file (comma-separated or a list);
                         empty = proportional to each file's number of examples.
    data.eval            (eval_file) held-out JSONL for the periodic evaluation (the last
                         assistant turn of each line is the reference); or
    data.eval_fraction   the share of each training file's conversations held out instead (0 =
                         none; not both).
    data.tokenizer       "bytes" ("bytes_image": with Gemma 4's image tokens); or a directory
                         with tokenizer.json or tokenizer.model and a chat template; empty = the
                         --init_from checkpoint's.
    data.max_images      I: image slots per example (0 = text only); an example with more
                         images is an error.
    data.max_soft_tokens the image processor's soft-token budget per image (0 = the checkpoint's
                         or the vision config's).
    data.prompt_len      P: prompt slots (the rendered history and generation prompt, BOS
                         included, left-padded).
    data.num_canvases    K: reply canvases of model.canvas_length tokens (the sampler's budget
                         is K * canvas_length).
    data.overflow        prompts longer than P / replies longer than K canvases:
                         "truncate_left" (prompts lose their oldest tokens after BOS; replies
                         keep their beginning), "drop" (skip the example) or "error".
    data.seed            shuffling (per file, new every epoch) and the eval_fraction split.
    data.max_row_tokens  pack training examples into rows of this many slots (0 = off: one
                         example per row in the P + K*C layout); diffgemma/tasks/packing.py.
                         An example longer than a row is an error naming its line.
    data.max_row_examples  with packing, the most examples in one row (the canvases the
                         decoder runs per row; about max_row_tokens / the mean example length).
    data.num_threads, data.prefetch   grain reader threads and prefetched batches.
    data.thinking        render prompts in the chat template's thinking mode (enable_thinking)
                         and train the thoughts assistant turns carry (in the thinking channel,
                         before the answer); a thought in the data needs it. False: neither.
    eval.every_steps     periodic evaluation on the held-out set (0 = off).
    eval.num_examples    held-out examples it uses (0 = all; a seeded subset when fewer).
    eval.batch_size      sampler batch of evaluation.
    eval.metric          "exact" (stripped match), "choice" ("the answer is yes|no|maybe"),
                         "gsm8k" (the number after ####), "regex" (first group of
                         eval.answer_regex).
    eval.answer_regex    the pattern of metric "regex", with one capturing group.
    eval.seed            which held-out examples when num_examples is smaller than the set.
    eval.stop_check_step, eval.stop_overrun_warning   from that step on (0 = off), the periodic
                         eval warns in one line when at least that share of the held-out
                         replies hold the whole reference and go on past it (the stop is not
                         learned).
    rl.reward            an RL stage (configs/sdrl_chat.py), the task's section `rl`: one of
                         the metric names or the graded "prefix" (diffgemma/tasks/text_metrics.py;
                         configs/sdrl_chat.py's default); or
    rl.reward_fn         "package.module:function", called as function(prompt, reply,
                         reference) -> float in [0, 1] (the module docstring says with what).
  """

  train: tuple[str, ...]
  weights: tuple[float, ...]
  eval_file: str
  eval_fraction: float
  tokenizer: str
  prompt_len: int
  num_canvases: int
  overflow: str
  seed: int
  num_threads: int
  prefetch: int
  eval_num_examples: int
  eval_seed: int
  metric: str
  answer_regex: str
  reward: str
  reward_fn: str
  # The stop check of the periodic eval (`ChatTask.plateau_warning`); 0 = off.
  stop_check_step: int = 0
  stop_overrun_warning: float = 1.0
  thinking: bool = False
  max_images: int = 0  # image slots per example (0 = text only)
  max_soft_tokens: int = 0  # the image processor's budget (0 = the model's)
  max_row_tokens: int = 0  # packing off
  max_row_examples: int = 0


@dataclasses.dataclass(frozen=True)
class Example:
  """One training example (ids already fitted to the layout) and its texts."""

  prompt_ids: tuple[int, ...]
  target_ids: tuple[int, ...]
  source: str  # "file:line"
  prompt_text: str  # the last user turn before the reply
  reference: str  # the reply's content
  images: tuple[str, ...] = ()  # the prompt's image files, in placeholder order


def settings_from_config(config: ml_collections.ConfigDict) -> ChatSettings:
  """The chat keys of `config`, validated; ValueError (one line) if one is bad."""
  data, ev = config.data, config.eval
  train = _paths(data.get("train", ""), "data.train")
  weights = _floats(data.get("weights", ""), "data.weights")
  if weights and len(weights) != len(train):
    raise ValueError(f"data.weights has {len(weights)} entries for {len(train)} data.train files")
  if any(not (w > 0 and math.isfinite(w)) for w in weights):
    raise ValueError(f"data.weights must be positive, got {list(weights)}")
  eval_fraction = float(data.get("eval_fraction", 0.0))
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
  eval_file = data.get("eval", "") or ""
  if eval_file and eval_fraction:
    raise ValueError("set data.eval (a held-out file) or data.eval_fraction, not both")
  overflow = data.get("overflow", "truncate_left")
  if overflow not in chat_data.OVERFLOW_POLICIES:
    raise ValueError(f"unknown data.overflow {overflow!r}; choose one of "
                     f"{chat_data.OVERFLOW_POLICIES}")
  for key in ("prompt_len", "num_canvases"):
    if int(data.get(key, 0)) < 1:
      raise ValueError(f"data.{key} must be >= 1, got {data.get(key)}")
  for key in ("num_threads", "prefetch", "max_images", "max_soft_tokens", "max_row_tokens",
              "max_row_examples"):
    if int(data.get(key, 0)) < 0:
      raise ValueError(f"data.{key} must be >= 0, got {data.get(key)}")
  max_row_tokens, max_row_examples = (int(data.get(k, 0))
                                      for k in ("max_row_tokens", "max_row_examples"))
  if max_row_tokens and not max_row_examples:
    raise ValueError("data.max_row_tokens packs examples into rows: set data.max_row_examples "
                     "too (the most examples per row, about max_row_tokens / the mean example "
                     "length)")
  metric = ev.get("metric", "exact")
  answer_regex = ev.get("answer_regex", "") or ""
  try:
    text_metrics.check_metric(metric, answer_regex)
  except ValueError as e:
    raise ValueError(f"eval.metric / eval.answer_regex: {e}") from None
  stop_check_step = int(ev.get("stop_check_step", 0))
  stop_overrun_warning = float(ev.get("stop_overrun_warning", 1.0))
  if stop_check_step < 0 or not 0.0 < stop_overrun_warning <= 1.0:
    raise ValueError("eval.stop_check_step must be >= 0 and eval.stop_overrun_warning in (0, 1], "
                     f"got {stop_check_step} and {stop_overrun_warning}")
  if int(ev.get("num_examples", 0)) < 0:
    raise ValueError(f"eval.num_examples must be >= 0, got {ev.get('num_examples')}")
  thinking = data.get("thinking", False)
  if not isinstance(thinking, bool):
    raise ValueError(f"data.thinking must be True or False, got {thinking!r}")
  rl = config.get("rl")
  reward, reward_fn = DEFAULT_REWARD, ""
  if rl is not None:
    reward = rl.get("reward", DEFAULT_REWARD)
    if isinstance(reward, (dict, ml_collections.ConfigDict)):  # a {"name": ...} section
      reward = reward.get("name", DEFAULT_REWARD)
    reward_fn = rl.get("reward_fn", "") or ""
    if reward not in text_metrics.METRICS + text_metrics.GRADED:
      raise ValueError(f"unknown rl.reward {reward!r} for the chat task; choose one of "
                       f"{text_metrics.METRICS + text_metrics.GRADED} (or set rl.reward_fn)")
    if reward == "regex" and not answer_regex:
      raise ValueError("rl.reward='regex' needs eval.answer_regex")
  return ChatSettings(
      train=train, weights=weights, eval_file=eval_file, eval_fraction=eval_fraction,
      tokenizer=data.get("tokenizer", "") or "", prompt_len=int(data.prompt_len),
      num_canvases=int(data.num_canvases), overflow=overflow, seed=int(data.get("seed", 0)),
      num_threads=int(data.get("num_threads", 1)), prefetch=int(data.get("prefetch", 4)),
      eval_num_examples=int(ev.get("num_examples", 0)), eval_seed=int(ev.get("seed", 0)),
      metric=metric, answer_regex=answer_regex, reward=reward, reward_fn=reward_fn,
      stop_check_step=stop_check_step, stop_overrun_warning=stop_overrun_warning,
      thinking=thinking, max_images=int(data.get("max_images", 0)),
      max_soft_tokens=int(data.get("max_soft_tokens", 0)),
      max_row_tokens=max_row_tokens, max_row_examples=max_row_examples)


def model_has_vision_tower(model) -> bool:
  """Whether a model config (a `ModelConfig` or the run config's model section) has a vision
  tower: its `vision` is set."""
  return _field(model, "vision") is not None


def image_settings(model, init_from: str | None, max_soft_tokens: int = 0
                   ) -> image_processing.ImageSettings:
  """The image processor's sizes for a model: the source checkpoint's processor config where
  it ships one, else its vision config's patch_size, pooling_kernel_size and
  default_output_length (transformers' names), else Gemma 4's defaults; `max_soft_tokens` > 0
  overrides the budget."""
  source = model_source(init_from) if init_from else None
  found = image_processing.read_image_settings(source) if source and os.path.isdir(source) else None
  if found is None:
    vision, defaults = _field(model, "vision"), image_processing.ImageSettings()
    sizes = {name: _field(vision, key) for name, key in (
        ("patch_size", "patch_size"), ("pooling_kernel_size", "pooling_kernel_size"),
        ("max_soft_tokens", "default_output_length"))}
    found = image_processing.ImageSettings(**{k: int(v) if v is not None else getattr(defaults, k)
                                              for k, v in sizes.items()})
  if max_soft_tokens:
    found = dataclasses.replace(found, max_soft_tokens=max_soft_tokens)
  return found


def _field(section, name: str):
  """`name` of a config section: a ConfigDict or dict (`get`), a dataclass (attribute), or
  None."""
  if section is None:
    return None
  getter = getattr(section, "get", None)
  return getter(name) if callable(getter) else getattr(section, name, None)


def tokenizer_source(directory: str) -> str:
  """Where a checkpoint directory's tokenizer lives: the directory itself when it holds
  tokenizer files; for a training workdir, its own tokenizer setting (`data.tokenizer`) or, if
  that is empty, the tokenizer of the checkpoint it started from, recursively."""
  if any(os.path.isfile(os.path.join(directory, f))
         for f in (tokenizer_lib.TOKENIZER_JSON, tokenizer_lib.SENTENCEPIECE_MODEL)):
    return directory
  config_path = os.path.join(directory, "config.json")
  if os.path.isdir(os.path.join(directory, "checkpoints")) and os.path.isfile(config_path):
    saved = checkpointing.load_config(directory)
    data = saved.get("data") or {}
    if data.get("tokenizer"):
      return data["tokenizer"]
    if saved.get("init_from") and os.path.abspath(saved.init_from) != os.path.abspath(directory):
      return tokenizer_source(saved.init_from)
  return directory


def model_source(directory: str) -> str:
  """The model checkpoint a directory descends from: a training workdir's init_from,
  recursively (a workdir started from scratch is its own source); any other directory itself."""
  config_path = os.path.join(directory, "config.json")
  if os.path.isdir(os.path.join(directory, "checkpoints")) and os.path.isfile(config_path):
    saved = checkpointing.load_config(directory)
    if saved.get("init_from") and os.path.abspath(saved.init_from) != os.path.abspath(directory):
      return model_source(saved.init_from)
  return directory


def declared_stop_ids(init_from: str | None) -> tuple[int, ...]:
  """The stop ids the run's source checkpoint declares (generation_config.json's eos_token_id,
  else config.json's: what transformers' DiffusionGemma generate stops on); () without one."""
  if not init_from:
    return ()
  source = model_source(init_from)
  return model_dirs.declared_eos_ids(source) if os.path.isdir(source) else ()


def load_tokenizer(settings: ChatSettings, init_from: str | None, require_chat: bool = True):
  """The task's tokenizer (`data.tokenizer`, else the init_from checkpoint's, found through
  training workdirs); it must have a chat template and an end-of-turn marker (unless
  `require_chat` is False: plain-text prompts only)."""
  source = settings.tokenizer or (tokenizer_source(init_from) if init_from else "")
  if not source:
    raise ValueError("no tokenizer: set data.tokenizer to a tokenizer directory or 'bytes', or "
                     "start from a checkpoint with --init_from")
  if source not in tokenizer_lib.BUILT_IN and not os.path.isdir(source):
    raise ValueError(f"tokenizer directory {source} not found (data.tokenizer or --init_from)")
  tok = tokenizer_lib.load_tokenizer(source)
  if not require_chat:
    return tok
  if tok.chat_template is None:
    raise tokenizer_lib.TokenizerError(
        f"tokenizer in {source} has no chat template: add chat_template.jinja (or a "
        "chat_template entry in tokenizer_config.json) beside it")
  if tok.eot_id is None:
    raise tokenizer_lib.TokenizerError(
        f"tokenizer in {source} has no end-of-turn marker {tok.end_of_turn!r}")
  return tok


def load_reward_fn(spec: str) -> Callable[[str, str, str], float]:
  """`package.module:function` imported; ValueError (one line) if it cannot be."""
  module_name, sep, name = spec.partition(":")
  if not sep or not module_name or not name:
    raise ValueError(f"rl.reward_fn {spec!r} must look like 'package.module:function'")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # anything the module raises on import
    raise ValueError(f"rl.reward_fn: cannot import {module_name}: "
                     f"{type(e).__name__}: {errors.one_line(e)}") from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ValueError(f"rl.reward_fn: {module_name} has no function {name!r}")
  return fn


class ChatTask(RlTask):
  """Chat SFT on conversations (see the module docstring).

  Beyond `Task`: `tokenizer`, `settings`, `data_report()`, `overflow_counts`, and
  `describe_file(path)` (what the model sees, for scripts/show_examples.py).
  """

  name = "chat"
  headline_metric = "accuracy"

  def __init__(self, settings: ChatSettings, tok, layout: Layout,
               declared_stop_ids: Sequence[int] = (), chat_prompts: bool = True,
               image_settings: image_processing.ImageSettings | None = None,
               has_vision_tower: bool = False):
    self.settings, self.tokenizer, self._layout = settings, tok, layout
    self.image_settings = image_settings or image_processing.ImageSettings()
    self.has_vision_tower = has_vision_tower
    self._image_soft_tokens: dict[str, int] = {}  # path -> soft tokens (each image decoded once)
    self._declared_stop_ids = tuple(int(i) for i in declared_stop_ids)
    self._pattern = text_metrics.check_metric(settings.metric, settings.answer_regex)
    self._reward_pattern = (None if settings.reward in text_metrics.GRADED else
                            text_metrics.check_metric(settings.reward, settings.answer_regex))
    self._reward_fn = load_reward_fn(settings.reward_fn) if settings.reward_fn else None
    if settings.thinking and chat_prompts:
      tok.check_thinking_mode("data.thinking")
    # `chat_prompts=False` (sample.py --chat=false): plain-text prompts, no template needed.
    min_prompt = ((1 if self._starts_with_bos() else 0) + len(self.generation_prompt_ids()) + 1
                  if chat_prompts else 1)
    if layout.prompt_len < min_prompt:
      raise ValueError(f"data.prompt_len={layout.prompt_len} cannot hold BOS, the generation "
                       f"prompt and one token ({min_prompt}); raise it")
    self.overflow_counts: dict[str, chat_data.OverflowCounts] = {}
    self._orders = {}
    self._files: list[str] = []
    self._train: list[list[Example]] = []
    held_out: list[chat_data.Conversation] = []
    for f, path in enumerate(settings.train):
      conversations = chat_data.read_jsonl(path)
      train, held = chat_data.split_held_out(conversations, settings.eval_fraction,
                                             settings.seed, f)
      counts = chat_data.OverflowCounts()
      examples = [e for c in train for e in self._examples(c, counts)]
      if not examples:
        raise chat_data.ChatDataError(f"{path}: no training example left after "
                                      f"data.overflow={settings.overflow}")
      self._files.append(path)
      self._train.append(examples)
      self.overflow_counts[path] = counts
      held_out += held
    if settings.eval_file:
      held_out = chat_data.read_jsonl(settings.eval_file)
    self._held_out = None
    if held_out:
      self._held_out = self._prompts_of(held_out, "held out")
      if settings.eval_num_examples and len(self._held_out) > settings.eval_num_examples:
        rng = np.random.default_rng(settings.eval_seed)
        keep = np.sort(rng.permutation(len(self._held_out))[:settings.eval_num_examples])
        self._held_out = self._held_out.take(keep)

  # ---------------------------------------------------------------- shapes

  @property
  def layout(self) -> Layout:
    return self._layout

  @property
  def packing(self) -> PackedLayout | None:
    """Rows of data.max_row_tokens slots, up to data.max_row_examples examples each (None:
    data.max_row_tokens = 0, no packing; or image data, data.max_images > 0: packed rows do not
    carry images, so image examples stay one per row, as the data report says)."""
    s = self.settings
    if not s.max_row_tokens or s.max_images:
      return None
    return PackedLayout(s.max_row_tokens, s.max_row_examples, self._layout.canvas_length,
                        self._layout.num_canvases)

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """The one stop path of chat replies (evaluation, SD·RL rollouts, sample.py, reply cuts):
    the tokenizer's EOS and end-of-turn (what SFT targets end with), then the ids the source
    checkpoint declares (generation_config.json's eos_token_id, as transformers' generate)."""
    return tuple(dict.fromkeys(self.tokenizer.stop_ids + self._declared_stop_ids))

  @property
  def min_vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  @property
  def image_slots(self) -> ImageSlots | None:
    """data.max_images slots of the image processor's patches (None: max_images = 0)."""
    if not self.settings.max_images:
      return None
    return ImageSlots(self.settings.max_images, self.image_settings.max_patches,
                      self.image_settings.patch_dim)

  # ---------------------------------------------------------------- examples

  def generation_prompt_ids(self) -> list[int]:
    """The ids the template adds for `add_generation_prompt` (what follows the common prefix of
    a one-turn conversation rendered with and without it)."""
    turn = [{"role": "user", "content": "x"}]
    with_prompt = self._render(turn, add_generation_prompt=True)
    without = self._render(turn, add_generation_prompt=False)
    n = 0
    while n < min(len(with_prompt), len(without)) and with_prompt[n] == without[n]:
      n += 1
    return with_prompt[n:]

  def _starts_with_bos(self) -> bool:
    ids = self._render([{"role": "user", "content": "x"}], add_generation_prompt=True)
    return bool(ids) and ids[0] == self.tokenizer.bos_id

  def _render(self, messages: Sequence[dict], add_generation_prompt: bool,
              image_soft_tokens: Sequence[int] | None = None) -> list[int]:
    """The template's ids of `messages`, in thinking mode when data.thinking asks for it, its
    image tokens expanded to placeholders of `image_soft_tokens` (`Tokenizer.render`)."""
    return self.tokenizer.render(messages, add_generation_prompt=add_generation_prompt,
                                 enable_thinking=self.settings.thinking,
                                 image_soft_tokens=image_soft_tokens)

  def _render_prompt(self, conversation: chat_data.Conversation, history: Sequence[dict]
                     ) -> tuple[list[int], tuple[str, ...]]:
    """(ids, image paths) of a history with the generation prompt; its images checked against
    the model and the layout and expanded to their placeholders."""
    images = chat_data.image_paths(history)
    return self.render_messages(history, conversation.source), images

  def render_messages(self, messages: Sequence[dict], where: str) -> list[int]:
    """Ids of `messages` (content parts with absolute image paths allowed) with the generation
    prompt, each image's placeholder expanded: what the encoder reads. ChatDataError (one line,
    naming `where`) for a bad image, an image the model cannot take, or a template error."""
    images = chat_data.image_paths(messages)
    chat_data.check_images(len(images), self.has_vision_tower, self.settings.max_images, where)
    try:
      soft_tokens = [self._soft_tokens(path) for path in images] if images else None
      return self._render(messages, add_generation_prompt=True, image_soft_tokens=soft_tokens)
    except (tokenizer_lib.TokenizerError, image_processing.ImageError) as e:
      raise chat_data.ChatDataError(f"{where}: {e}") from None

  def _soft_tokens(self, path: str) -> int:
    """An image file's soft tokens, decoding it in full the first time (so a damaged file fails
    before training starts)."""
    if path not in self._image_soft_tokens:
      height, width = image_processing.image_size(path)
      try:
        count = image_processing.num_soft_tokens(height, width, self.image_settings)
      except ValueError as e:
        raise image_processing.ImageError(f"image {path}: {e}") from None
      self._image_soft_tokens[path] = count
    return self._image_soft_tokens[path]

  def process_images(self, paths: Sequence[str]) -> image_processing.ProcessedImages:
    """The images of one example in its data.max_images slots (absent ones padding)."""
    return image_processing.process_images(list(paths), self.image_settings,
                                           num_slots=self.settings.max_images)

  def _image_ids(self) -> tuple[int, ...]:
    return self.tokenizer.image_token_ids or ()

  def target_ids(self, content: str, thought: str | None = None) -> list[int]:
    """The supervised reply: its thought in the template's thinking channel (if it has one),
    its content, stripped, then the end-of-turn marker. TokenizerError (one line) for a thought
    the template cannot write (`Tokenizer.thought_text`)."""
    text = content.strip()
    if thought:
      text = self.tokenizer.thought_text(thought) + text
    return self.tokenizer.encode(text) + [self.tokenizer.eot_id]

  def _reply_target(self, message: dict, where: str) -> list[int]:
    """`target_ids` of an assistant message (its thought only under data.thinking); one-line
    ChatDataError naming `where` otherwise."""
    thought = message.get(chat_data.THOUGHT_KEY)
    if thought and not self.settings.thinking:
      raise chat_data.ChatDataError(
          f"{where}: the reply has a thought ({chat_data.THOUGHT_KEY}) but data.thinking is "
          "False; set --config.data.thinking=True to train thinking mode, or drop the thought")
    try:
      return self.target_ids(chat_data.message_text(message), thought)
    except tokenizer_lib.TokenizerError as e:
      raise chat_data.ChatDataError(f"{where}: {e}") from None

  def _examples(self, conversation: chat_data.Conversation, counts: chat_data.OverflowCounts
                ) -> list[Example]:
    """One example per assistant turn, fitted to the layout under the overflow policy."""
    s, out = self.settings, []
    for j, message in enumerate(conversation.messages):
      if message["role"] != "assistant":
        continue
      history = conversation.messages[:j]
      where = f"{conversation.source} (assistant turn {j + 1})"
      ids, images = self._render_prompt(conversation, history)
      prompt = chat_data.fit_prompt(ids, self._layout.prompt_len, self.tokenizer.bos_id,
                                    s.overflow, where, counts, self._image_ids())
      if prompt is None:
        continue
      reply = chat_data.message_text(message)
      target = chat_data.fit_target(self._reply_target(message, where),
                                    self._layout.response_len, s.overflow, where, counts)
      if target is None:
        continue
      self._check_row_fits(len(prompt), len(target), where)
      counts.examples += 1
      out.append(Example(tuple(prompt), tuple(target), conversation.source,
                         _last_user_text(history), reply, images))
    return out

  def _check_row_fits(self, prompt_len: int, target_len: int, where: str) -> None:
    """ChatDataError (one line) when packing is on and the example fills more than a row."""
    rows = self.packing
    c = self._layout.canvas_length
    length = prompt_len + chat_data.num_target_canvases(target_len, c) * c
    if rows is not None and length > rows.row_tokens:
      raise chat_data.ChatDataError(
          f"{where}: the example is {length} tokens packed (a prompt of {prompt_len} and "
          f"canvases of {c} for a reply of {target_len}), longer than a row, "
          f"data.max_row_tokens={rows.row_tokens}; set data.max_row_tokens to at least "
          f"{self._layout.seq_len} (data.prompt_len + data.num_canvases x {c}: every example "
          "then fits)")

  def layout_example(self, example: Example) -> dict:
    """tokens / valid / loss_mask [P + K*C] of one example (chat_data.layout_example); with
    data.max_images > 0, its images' pixel_values [I, M, D] and image_position_ids [I, M, 2]."""
    seq = chat_data.layout_example(example.prompt_ids, example.target_ids, self._layout,
                                   self.tokenizer.pad_id, self.tokenizer.eos_id)
    if self.settings.max_images:
      try:
        images = self.process_images(example.images)
      except (image_processing.ImageError, ValueError) as e:
        raise chat_data.ChatDataError(f"{example.source}: {errors.one_line(e)}") from None
      seq.update(pixel_values=images.pixel_values, image_position_ids=images.position_ids)
    return seq

  def _prompts_of(self, conversations: Sequence[chat_data.Conversation], split: str) -> Prompts:
    """Held-out prompts: each conversation's last assistant turn, its history as the prompt.
    References must hold an answer under the metric."""
    counts = chat_data.OverflowCounts()
    rows, valids, references, records, fixed = [], [], [], [], []
    infill = {c.infill is not None for c in conversations}
    if len(infill) > 1:
      raise chat_data.ChatDataError(
          f"{conversations[0].path}: some records have an \"infill\" split and some do not; "
          "a held-out set is all infill records or none")
    images_of_rows = []
    for conversation in conversations:
      messages = conversation.messages
      j = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
      reference = chat_data.message_text(messages[j])
      if text_metrics.reference_answer(self.settings.metric, reference, self._pattern) is None:
        raise chat_data.ChatDataError(
            f"{conversation.source}: the reference reply has no answer under "
            f"eval.metric={self.settings.metric!r}")
      ids, images = self._render_prompt(conversation, messages[:j])
      prompt = chat_data.fit_prompt(ids, self._layout.prompt_len, self.tokenizer.bos_id,
                                    self.settings.overflow, conversation.source, counts,
                                    self._image_ids())
      if prompt is None:
        continue
      counts.examples += 1
      tokens, valid = chat_data.left_pad(prompt, self._layout.prompt_len, self.tokenizer.pad_id)
      record = {"source": conversation.source, "prompt": _last_user_text(messages[:j])}
      if images:
        record["images"] = list(images)
      images_of_rows.append(images)
      if conversation.infill is not None:
        prefix, middle, suffix = conversation.infill
        try:
          fixed.append(self.infill_slots(prefix, suffix,
                                         len(self.tokenizer.encode(middle))))
        except ValueError as e:
          raise chat_data.ChatDataError(f"{conversation.source}: {e}") from None
        record.update(infill_prefix=prefix, reference_middle=middle, infill_suffix=suffix)
      rows.append(tokens)
      valids.append(valid)
      references.append(reference)
      records.append(record)
    self.overflow_counts[split] = counts
    if not rows:
      raise chat_data.ChatDataError(f"no {split} example left after "
                                    f"data.overflow={self.settings.overflow}")
    fixed_arrays = ((np.stack([t for t, _ in fixed]), np.stack([m for _, m in fixed])) if fixed
                    else (None, None))
    return Prompts(np.stack(rows), np.stack(valids), references, records, *fixed_arrays,
                   *self._prompt_images(images_of_rows))

  def _prompt_images(self, images_of_rows: Sequence[Sequence[str]]
                     ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(pixel_values_NxIxMxD, image_positions_NxIxMx2) of prompts' images; (None, None) for a
    text-only task (data.max_images = 0)."""
    if not self.settings.max_images:
      return None, None
    processed = [self.process_images(paths) for paths in images_of_rows]
    return (np.stack([p.pixel_values for p in processed]),
            np.stack([p.position_ids for p in processed]))

  def _example_prompts(self, examples: Sequence[Example]) -> Prompts:
    pads = [chat_data.left_pad(e.prompt_ids, self._layout.prompt_len, self.tokenizer.pad_id)
            for e in examples]
    p = self._layout.prompt_len
    return Prompts(np.stack([t for t, _ in pads]), np.stack([v for _, v in pads]),
                   [e.reference for e in examples],
                   [{"source": e.source, "prompt": e.prompt_text,
                     "reply_slots": chat_data.layout_example(
                         e.prompt_ids, e.target_ids, self._layout, self.tokenizer.pad_id,
                         self.tokenizer.eos_id)["tokens"][p:]} for e in examples],
                   None, None, *self._prompt_images([e.images for e in examples]))

  # ---------------------------------------------------------------- training data

  def _order(self, stream: int):
    """The (file, example) order of a seed stream (cached: building it lists every example)."""
    if stream not in self._orders:
      sizes = [len(examples) for examples in self._train]
      weights = self.settings.weights or tuple(float(n) for n in sizes)
      self._orders[stream] = chat_data.mixed_order(sizes, weights, self.settings.seed, stream)
    return self._orders[stream]

  def _require_train(self):
    if not self._train:
      raise ValueError(NO_TRAINING_DATA)

  def train_batches(self, batch_size: int, num_steps: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1):
    """Batches of tokens / valid / loss_mask [B / process_count, P + K*C], or with packing B
    packed rows (`PackedLayout`). Raises at the call (not on the first batch) when there is no
    training data."""
    self._require_train()
    order = self._order(_TRAIN_STREAM)
    example_fn = lambda pair: self.layout_example(self._train[pair[0]][pair[1]])
    if self.packing is not None:
      return packing.packed_batches(order, example_fn, self.packing, batch_size, num_steps,
                                    start_step, process_index, process_count,
                                    self.settings.num_threads, self.settings.prefetch,
                                    self.settings.seed, self.tokenizer.pad_id)
    return chat_data.batches(order, example_fn, batch_size, num_steps, start_step,
                             process_index, process_count, self.settings.num_threads,
                             self.settings.prefetch)

  def train_examples(self, start: int, count: int) -> list[Example]:
    """Records start .. start+count-1 of the training order (what train_batches lays out)."""
    self._require_train()
    order = self._order(_TRAIN_STREAM)
    return [self._train[f][i] for f, i in (order[r] for r in range(start, start + count))]

  def data_report(self) -> str:
    """One line per data file: examples kept and what the overflow policy did; the held-out
    set. For the trainer to print once."""
    s = self.settings
    lines = []
    weights = s.weights or tuple(float(len(e)) for e in self._train)
    total = sum(weights) or 1.0
    for path, w in zip(self._files, weights):
      lines.append(f"train {path}: {self.overflow_counts[path].describe()}, mixing weight "
                   f"{w / total:.3f}")
    if not self._files:
      lines.append("train: none (data.train is empty)")
    if "held out" in self.overflow_counts:
      origin = s.eval_file or f"data.eval_fraction={s.eval_fraction}"
      lines.append(f"held out ({origin}): {self.overflow_counts['held out'].describe()}"
                   + (f", {len(self._held_out)} used by the periodic eval"
                      if self._held_out is not None else ""))
    lines.append(f"layout: prompt {self._layout.prompt_len}, {self._layout.num_canvases} canvases "
                 f"of {self._layout.canvas_length}; data.overflow={s.overflow}; tokenizer "
                 f"{self.tokenizer.directory} ({self.tokenizer.vocab_size} ids)")
    if s.max_images:
      im = self.image_settings
      lines.append(f"images: {s.max_images} slots per example, up to {im.max_soft_tokens} soft "
                   f"tokens each ({im.max_patches} patches of {im.patch_size} px, pooled "
                   f"{im.pooling_kernel_size} x {im.pooling_kernel_size})")
    if s.max_row_tokens and s.max_images:
      lines.append("packing: off for image data (data.max_images > 0): one example per row")
    if self.packing is not None and self._train:
      rows = self.packing
      sample = self.train_examples(0, 64 * rows.row_examples)
      c = rows.canvas_length
      lengths = [len(e.prompt_ids) + chat_data.num_target_canvases(len(e.target_ids), c) * c
                 for e in sample]
      per_row, share = packing.fill(lengths, rows, bins=16, seed=s.seed)
      lines.append(f"packing: rows of {rows.row_tokens} slots (data.max_row_tokens), at most "
                   f"{rows.row_examples} examples (data.max_row_examples); a mean example is "
                   f"{np.mean(lengths):.0f} slots, a row holds {per_row:.2f} examples and "
                   f"{share:.0%} of its slots are theirs (first {len(sample)} examples)")
    return "\n".join(lines)

  def describe_file(self, path: str, limit: int | None = None) -> list[dict]:
    """What training sees of a data file, example by example (after the overflow policy):
    source, prompt_text / target_text (specials shown), prompt_ids (BOS included, no padding,
    image placeholders expanded), target_ids (the supervised ids of every valid canvas, EOS
    fill included), num_canvases, images (the prompt's image files, in placeholder order)."""
    counts, out = chat_data.OverflowCounts(), []
    for conversation in chat_data.read_jsonl(path):
      for example in self._examples(conversation, counts):
        seq = self.layout_example(example)
        response = seq["tokens"][self._layout.prompt_len:]
        supervised = seq["loss_mask"][self._layout.prompt_len:]
        target = [int(t) for t in response[supervised]]
        out.append({
            "source": example.source,
            "prompt_text": self.tokenizer.decode(example.prompt_ids, skip_special_tokens=False),
            "target_text": self.tokenizer.decode(target, skip_special_tokens=False),
            "prompt_ids": list(example.prompt_ids), "target_ids": target,
            "num_canvases": len(target) // self._layout.canvas_length,
            "images": list(example.images)})
        if limit is not None and len(out) >= limit:
          break
      if limit is not None and len(out) >= limit:
        break
    self.overflow_counts[path] = counts
    return out

  # ---------------------------------------------------------------- evaluation

  def headline_metric_for(self, prompts: Prompts) -> str:
    """infill_accuracy on infill data, else accuracy."""
    return INFILL_METRIC if prompts.fixed_NxL is not None else self.headline_metric

  def infill_slots(self, prefix: str, suffix: str, middle_len: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The fixed tokens (tokens_L int32, mask_L bool over the K*C reply slots) of an infill:
    `prefix` and `suffix` encoded on their own, `middle_len` generated slots between them
    (`sampler.infill_slots`). The one path of infill data and sample.py --infill_*.
    ValueError (one line) if they do not fit the reply's slots."""
    prefix_ids = self.tokenizer.encode(prefix) if prefix else []
    return sampler.infill_slots(prefix_ids, self.tokenizer.encode(suffix), middle_len,
                                self._layout.response_len, self.tokenizer.pad_id)

  def infill_reply_text(self, tokens_L, fixed_mask_L) -> str:
    """An infilled reply's text: every slot through the last fixed one (a stop id drawn there
    does not end the reply: the sampler's rule), then the reply up to its first stop token."""
    fixed_end = _fixed_end(fixed_mask_L)
    tokens = np.asarray(tokens_L).reshape(-1)
    return self.tokenizer.decode(tokens[:fixed_end].tolist()) + self.reply_text(tokens[fixed_end:])

  def infill_middle_text(self, tokens_L, fixed_mask_L) -> str:
    """The generated middle of an infilled reply (the unfixed slots before the last fixed
    one), decoded with special tokens shown, so a stray stop or pad never matches."""
    fixed_end = _fixed_end(fixed_mask_L)
    middle = np.asarray(tokens_L).reshape(-1)[:fixed_end][~np.asarray(fixed_mask_L)[:fixed_end]]
    return self.tokenizer.decode(middle.tolist(), skip_special_tokens=False)

  def eval_prompts(self) -> Prompts | None:
    return self._held_out

  def load_eval_file(self, path: str, limit: int | None = None) -> Prompts:
    conversations = chat_data.read_jsonl(path)
    if limit is not None:
      conversations = conversations[:limit]
    return self._prompts_of(conversations, path)

  def reply_ids(self, tokens_L: np.ndarray) -> list[int]:
    """A generated row's reply: the ids before the first stop id, pads dropped. A full
    sequence (P + K*C) is cut to its generated part first."""
    tokens = np.asarray(tokens_L).reshape(-1)
    if len(tokens) == self._layout.seq_len:
      tokens = tokens[self._layout.prompt_len:]
    stops, pad = set(self.stop_token_ids), self.tokenizer.pad_id
    reply = []
    for t in tokens.tolist():
      if t in stops:
        break
      if t != pad:
        reply.append(t)
    return reply

  def split_reply(self, tokens) -> tuple[str | None, str]:
    """(thought, answer) of a generated row's reply (`reply_ids`, then `split_reply_ids`): the
    one cut of evaluation, rewards, sample.py and the harness."""
    return self.split_reply_ids(self.reply_ids(tokens))

  def split_reply_ids(self, ids: Sequence[int]) -> tuple[str | None, str]:
    """(thought, answer) texts of a reply's ids: the answer is what follows the last close of a
    thinking channel, the thought the channel's text (its name and the surrounding whitespace
    stripped). A reply that opens no channel is all answer (thought None); one whose last
    channel never closes (the budget ended inside a thought) has no answer ("")."""
    ids = list(ids)
    opening, closing = self.tokenizer.channel_marker_ids()
    opened, closed = _find(ids, opening), _find(ids, closing, last=True)
    if opened is None and closed is None:
      return None, self.tokenizer.decode(ids)
    start = 0 if opened is None else opened + len(opening)
    last_open = _find(ids, opening, last=True)
    if closed is None or (last_open is not None and last_open > closed):
      thought, answer = ids[start:], []  # a channel still open: no answer yet
    else:
      thought, answer = ids[start:closed], ids[closed + len(closing):]
    text = self.tokenizer.decode(thought)
    channel = tokenizer_lib.THOUGHT_CHANNEL + "\n"
    return (text[len(channel):] if text.startswith(channel) else text).strip(), (
        self.tokenizer.decode(answer))

  def _stopped(self, tokens_L: np.ndarray) -> bool:
    return bool(np.isin(np.asarray(tokens_L), self.stop_token_ids).any())

  def reply_text(self, tokens, prompts=None, row=0, first_slot=0) -> str:
    """The reply up to its first stop token, decoded (a canvas shown on its own: its text)."""
    del prompts, row, first_slot  # a canvas's text reads the same wherever it sits
    return self.tokenizer.decode(self.reply_ids(tokens))

  def prompt_text(self, prompts: Prompts, row: int = 0) -> str:
    ids = np.asarray(prompts.prompt_NxP[row])[np.asarray(prompts.valid_NxP[row], bool)]
    return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

  def score(self, prompts: Prompts, tokens_NxL: np.ndarray, stats: dict[str, np.ndarray]
            ) -> tuple[dict[str, float], list[dict]]:
    """accuracy (eval.metric), answered (an answer could be extracted), stopped (the reply
    ended with a stop token within the budget), overran (the reply is the whole reference and
    goes on past it: the content was learned, the stop was not), canvases_per_reply (from
    stats["num_canvases"] when the sampler gives it); one record per row: source, prompt, reply,
    reference, correct, overran, answer, reference_answer. A reply that thinks is judged by its
    answer after the thought (`split_reply`): "reply" is that answer, "thought" the thought.
    Infill data (`prompts.fixed_NxL`): the reply is `infill_reply_text` (the whole reply, given
    parts included, is what accuracy judges), stopped counts stop tokens after the suffix only,
    and infill_accuracy is the share of rows whose middle (`infill_middle_text`) equals the
    reference middle exactly; records add middle and infill_correct."""
    records, correct, answered, stopped, infill_correct, overran = [], [], [], [], [], []
    for i, row in enumerate(np.asarray(tokens_NxL)):
      record = dict(prompts.records[i]) if prompts.records else {}
      record.pop("reply_slots", None)  # a rollout example's layout, not a prediction's field
      if prompts.fixed_NxL is None:
        thought, reply = self.split_reply(row)
        if thought is not None:
          record["thought"] = thought
        stopped.append(self._stopped(row))
      else:
        mask_L = prompts.fixed_mask_NxL[i]
        reply = self.infill_reply_text(row, mask_L)
        stopped.append(self._stopped(np.asarray(row)[_fixed_end(mask_L):]))
        middle = self.infill_middle_text(row, mask_L)
        infill_correct.append(middle == record["reference_middle"])
        record.update(middle=middle, infill_correct=infill_correct[-1])
      verdict = text_metrics.judge(self.settings.metric, reply, prompts.references[i],
                                   self._pattern)
      overran.append(overruns(reply, prompts.references[i]))
      record.update(reply=reply, reference=prompts.references[i], correct=verdict.correct,
                    overran=overran[-1], answer=verdict.answer,
                    reference_answer=verdict.reference_answer)
      records.append(record)
      correct.append(verdict.correct)
      answered.append(verdict.answer is not None)
    metrics = {"accuracy": float(np.mean(correct)) if correct else 0.0,
               "answered": float(np.mean(answered)) if answered else 0.0,
               "stopped": float(np.mean(stopped)) if stopped else 0.0,
               "overran": float(np.mean(overran)) if overran else 0.0}
    if prompts.fixed_NxL is not None:
      metrics[INFILL_METRIC] = float(np.mean(infill_correct)) if infill_correct else 0.0
    if "num_canvases" in stats:
      metrics["canvases_per_reply"] = float(np.mean(stats["num_canvases"]))
    return metrics, records

  def seen_split(self, records: list[dict], train_paths) -> dict:
    """accuracy on held-out prompts whose last user text is / is not a user turn of the
    training files (`chat_data.seen_prompt_split`): memorising against generalising."""
    return chat_data.seen_prompt_split(records, chat_data.user_texts(train_paths))

  def plateau_warning(self, step: int, metrics: dict[str, float]) -> str | None:
    """From eval.stop_check_step on: a warning when at least eval.stop_overrun_warning of the
    held-out replies overran (`overruns`), the sign of a run that writes the reply but has not
    learned where it ends."""
    s = self.settings
    if not s.stop_check_step or step < s.stop_check_step or "overran" not in metrics:
      return None
    if metrics["overran"] < s.stop_overrun_warning:
      return None
    return (f"warning: at step {step} {metrics['overran']:.0%} of the held-out replies hold the "
            "whole reference and go on past it: the stop is not being learned; "
            "scripts/chat_stop_diagnostics.py measures it, docs/chat.md lists what helps")

  # ---------------------------------------------------------------- sampling from text

  def prompt_ids(self, text: str, chat: bool = True, images: Sequence[str] = ()) -> list[int]:
    """The ids of a typed prompt, unpadded: one user turn of the chat template (the image files
    `images` first, then the text) and the opening of the model turn (`chat`; in thinking mode
    under data.thinking), else BOS and the plain text. TokenizerError / InputError (one
    line)."""
    if images:
      if not chat:
        raise ValueError("an image prompt needs the chat template (drop --chat=false)")
      return self.render_messages(image_prompt_messages(text, images), "--prompt")
    return _typed_prompt_ids(self.tokenizer, text, chat, self.settings.thinking)

  def prompt_from_text(self, text: str, chat: bool = True, images: Sequence[str] = ()
                       ) -> Prompts:
    """One typed prompt as a 1-row batch; `images` (file paths) go before the text in the user
    turn and beside the tokens as the vision tower takes them."""
    if not text.strip():
      raise ValueError("the prompt is empty")
    counts = chat_data.OverflowCounts()
    policy = "error" if self.settings.overflow == "drop" else self.settings.overflow
    ids = chat_data.fit_prompt(self.prompt_ids(text, chat, images), self._layout.prompt_len,
                               self.tokenizer.bos_id, policy, "--prompt", counts,
                               self._image_ids())
    tokens, valid = chat_data.left_pad(ids, self._layout.prompt_len, self.tokenizer.pad_id)
    record = {"prompt": text, **({"images": list(images)} if images else {})}
    return Prompts(tokens[None], valid[None], [None], [record], None, None,
                   *self._prompt_images([tuple(images)]))

  def token_strings(self, tokens: Sequence[int]) -> list[str]:
    out = []
    for t in tokens:
      t = int(t)
      out.append(self.tokenizer.decode([t], skip_special_tokens=False)
                 if 0 <= t < self.tokenizer.vocab_size else f"<id {t}>")
    return out

  # ---------------------------------------------------------------- SD·RL

  def rollout_prompts(self, iteration: int, num_prompts: int) -> Prompts:
    """Training examples iteration*n .. iteration*n + n-1 of a seeded order of the training
    split (files mixed by weight, reshuffled every epoch), their replies as references."""
    self._require_train()
    order = self._order(_ROLLOUT_STREAM)
    start = iteration * num_prompts
    examples = [self._train[f][i] for f, i in (order[r] for r in range(start,
                                                                        start + num_prompts))]
    return self._example_prompts(examples)

  def reference_reply(self, prompts: Prompts) -> np.ndarray | None:
    """The rollout examples' replies as training lays them out (reply, end-of-turn, EOS fill
    to the canvas's end, pad); None for prompts that are not rollout examples."""
    records = prompts.records or []
    if len(records) != len(prompts) or not all(r and "reply_slots" in r for r in records):
      return None
    return np.stack([r["reply_slots"] for r in records]).astype(np.int32)

  def reward(self, prompts: Prompts, tokens_BxL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rl.reward's verdict (1 or 0) or graded score (text_metrics.GRADED), or
    rl.reward_fn's value clipped to [0, 1], of each reply's answer after its thought
    (`split_reply`); a row is correct when it scores 1."""
    scores = []
    for i, row in enumerate(np.asarray(tokens_BxL)):
      reply, reference = self.split_reply(row)[1], prompts.references[i]
      if self._reward_fn is None and self.settings.reward in text_metrics.GRADED:
        scores.append(text_metrics.graded(self.settings.reward, reply, reference))
        continue
      if self._reward_fn is None:
        scores.append(float(text_metrics.judge(self.settings.reward, reply, reference,
                                               self._reward_pattern).correct))
        continue
      prompt = (prompts.records[i] or {}).get("prompt", "") if prompts.records else ""
      value = self._reward_fn(prompt, reply, reference)
      try:
        value = float(value)
      except (TypeError, ValueError):
        raise ValueError(f"rl.reward_fn {self.settings.reward_fn} returned {value!r}, not a "
                         "number") from None
      if not math.isfinite(value):
        raise ValueError(f"rl.reward_fn {self.settings.reward_fn} returned {value}")
      scores.append(min(max(value, 0.0), 1.0))
    score_B = np.asarray(scores, np.float32)
    return score_B, score_B >= 1.0


def from_config(config: ml_collections.ConfigDict, training: bool = True,
                planning: bool = False) -> ChatTask:
  """The chat task of a run config (`config.init_from`: the checkpoint the run starts from, if
  any; its tokenizer is the default). Reads and checks all data; ValueError (one line), also
  when training has no data.train. With `training=False` (evaluating or sampling a finished
  run) the training files are not read.
  `planning` (--dry_run): a memory plan needs the layout only, so without a tokenizer or an
  init_from the byte tokenizer stands in."""
  settings = settings_from_config(config)
  if not training:
    settings = dataclasses.replace(settings, train=(), weights=(), eval_file="",
                                   eval_fraction=0.0)
  elif not planning and not settings.train:
    raise ValueError(NO_TRAINING_DATA)
  if planning and not settings.tokenizer and not config.get("init_from"):
    settings = dataclasses.replace(settings, tokenizer=tokenizer_lib.BYTES)
  tok = load_tokenizer(settings, config.get("init_from"))
  model = config.model
  for name, ours in (("pad", tok.pad_id), ("eos", tok.eos_id), ("bos", tok.bos_id)):
    theirs = model.get(f"{name}_token_id")
    if theirs is not None and theirs != ours:
      raise ValueError(f"the tokenizer's {name} id is {ours} but model.{name}_token_id is "
                       f"{theirs}; use the model's own tokenizer")
  if settings.max_images:
    check_image_token_ids(tok, model)
  layout = Layout(settings.prompt_len, settings.num_canvases, int(model.canvas_length))
  init_from = config.get("init_from")
  return ChatTask(settings, tok, layout, declared_stop_ids(init_from),
                  image_settings=image_settings(model, init_from, settings.max_soft_tokens),
                  has_vision_tower=model_has_vision_tower(model))


def check_image_token_ids(tok, model) -> None:
  """ValueError (one line) unless a model with a vision tower (a `ModelConfig` or the run
  config's model section) names the tokenizer's image tokens as its boi / image / eoi ids: its
  vision tower's soft tokens go where its image_token_id is, so any other id would leave the
  images unseen. A model without a tower or a tokenizer without image tokens is left to
  `chat_data.check_images`."""
  if tok.image_token_ids is None or not model_has_vision_tower(model):
    return
  for name, ours in zip(("boi", "image", "eoi"), tok.image_token_ids):
    theirs = _field(model, f"{name}_token_id")
    if theirs != ours:
      raise ValueError(f"the tokenizer's {name} token is id {ours} but model.{name}_token_id is "
                       f"{theirs}; use the model's own tokenizer (a model trained from scratch: "
                       f"set model.{name}_token_id={ours})")


def checkpoint_task(directory: str, max_new_tokens: int, text: str, chat: bool = True,
                    thinking: bool = False, images: Sequence[str] = ()) -> ChatTask:
  """The chat task of a model checkpoint directory with its own tokenizer, for sampling a reply
  to `text` (sample.py): the task's defaults (`settings_from_config`), no data, a
  prompt length of exactly `text`'s ids (`prompt_ids`, with the placeholders of the image files
  `images`), so nothing is padded, and the canvases that hold `max_new_tokens` (the
  checkpoint's canvas length, read without the weights).
  `chat=False`: plain-text prompts, and a tokenizer without a chat template is accepted.
  `thinking`: the prompt in the template's thinking mode (sample.py --thinking).
  TokenizerError, CheckpointFormatError, InputError or ValueError (one line)."""
  if thinking and not chat:
    raise ValueError("thinking mode is the chat template's: it needs chat prompts (--chat)")
  config = ml_collections.ConfigDict(dict(data=dict(prompt_len=1, num_canvases=1, tokenizer="",
                                                    thinking=thinking), eval={}))
  settings = dataclasses.replace(settings_from_config(config), max_images=len(images))
  tok = load_tokenizer(settings, directory, require_chat=chat)
  if thinking:
    tok.check_thinking_mode("--thinking")
  arch = model_dirs.read_model_config(directory)
  if images:
    check_image_token_ids(tok, arch)
  num_canvases = math.ceil(max_new_tokens / arch.canvas_length)

  def task(prompt_len: int) -> ChatTask:
    return ChatTask(dataclasses.replace(settings, prompt_len=prompt_len, num_canvases=num_canvases),
                    tok, Layout(prompt_len, num_canvases, arch.canvas_length),
                    declared_stop_ids(directory), chat_prompts=chat,
                    image_settings=image_settings(arch, directory),
                    has_vision_tower=model_has_vision_tower(arch))

  prompt_len = len(_typed_prompt_ids(tok, text, chat, thinking))
  if images:  # the placeholders' length needs the task's image processing: size it, then fit
    prompt_len = len(task(prompt_len + 1).prompt_ids(text, chat, images))
  return task(prompt_len)


def overruns(reply: str, reference: str) -> bool:
  """The reply is the whole (stripped, non-empty) reference and then more: it did not stop."""
  reply, reference = reply.strip(), reference.strip()
  return bool(reference) and len(reply) > len(reference) and reply.startswith(reference)


def _typed_prompt_ids(tok, text: str, chat: bool, thinking: bool = False) -> list[int]:
  if chat:
    return tok.chat_prompt(text, enable_thinking=thinking)
  return [tok.bos_id] + tok.encode(text)


def _find(ids: Sequence[int], marker: Sequence[int], last: bool = False) -> int | None:
  """Where `marker` (a run of ids) first (or last) starts in `ids`; None if nowhere."""
  n = len(marker)
  starts = range(len(ids) - n, -1, -1) if last else range(len(ids) - n + 1)
  return next((i for i in starts if n and list(ids[i:i + n]) == list(marker)), None)


def _fixed_end(fixed_mask_L) -> int:
  """One past the last fixed slot of an infill (0 without one)."""
  fixed = np.flatnonzero(np.asarray(fixed_mask_L))
  return int(fixed[-1]) + 1 if len(fixed) else 0


def image_prompt_messages(text: str, images: Sequence[str]) -> list[dict]:
  """One user turn of image files (absolute paths) then `text`, as content parts."""
  parts = [{"type": "image", "path": os.path.abspath(path)} for path in images]
  return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _last_user_text(history: Sequence[dict]) -> str:
  return next((chat_data.message_text(m) for m in reversed(history) if m["role"] == "user"), "")


def _paths(value, key: str) -> tuple[str, ...]:
  """A path, comma-separated paths, or a list of paths."""
  if isinstance(value, str):
    items = value.split(",") if value else []
  elif isinstance(value, (list, tuple)):
    items = list(value)
  else:
    raise ValueError(f"{key} must be a path or a list of paths, got {value!r}")
  items = [str(p).strip() for p in items]
  if any(not p for p in items):
    raise ValueError(f"{key} has an empty path: {value!r}")
  return tuple(items)


def _floats(value, key: str) -> tuple[float, ...]:
  if isinstance(value, str):
    items = value.split(",") if value.strip() else []
  elif isinstance(value, (list, tuple)):
    items = list(value)
  elif isinstance(value, (int, float)):
    items = [value]
  else:
    raise ValueError(f"{key} must be a list of numbers, got {value!r}")
  try:
    return tuple(float(x) for x in items)
  except (TypeError, ValueError):
    raise ValueError(f"{key} must be a list of numbers, got {value!r}") from None

