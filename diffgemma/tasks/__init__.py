"""Tasks by name: `config.task.name` picks the module that builds the run's `Task`.

Only this registry, the task modules themselves and `configs/` name a task module; everything
else receives a `Task` (diffgemma/tasks/base.py) from `make_task`.
"""

from __future__ import annotations

import importlib

import ml_collections

from diffgemma.tasks.base import Layout, Prompts, RlTask, Task

# name -> module defining `from_config(config, training, planning) -> Task`.
TASKS = {"sudoku": "diffgemma.tasks.sudoku", "chat": "diffgemma.tasks.chat"}
DEFAULT_TASK = "sudoku"  # configs written before tasks existed are Sudoku runs
TEXT_TASK = "chat"  # the task that samples free text from a model checkpoint (sample.py)


def task_name(config: ml_collections.ConfigDict) -> str:
  section = config.get("task")
  name = section.get("name", DEFAULT_TASK) if section is not None else DEFAULT_TASK
  if name not in TASKS:
    raise ValueError(f"unknown task.name {name!r}; choose one of {tuple(TASKS)}")
  return name


def tokenization_keys(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """Config keys ("section.key") that fix how the task maps records to token ids: a run started
  from another run of the same task must keep them (its embeddings were trained on them)."""
  return tuple(getattr(importlib.import_module(TASKS[task_name(config)]), "TOKENIZATION_KEYS", ()))


def make_task(config: ml_collections.ConfigDict, training: bool = True,
              planning: bool = False) -> Task:
  """The run's task, built from (and validating) its config sections, and checked against the
  model's vocabulary; ValueError if bad. `training=False` (evaluation, sampling): the task need
  not read its training data. `planning` (--dry_run): only the layout and shapes matter; no
  data is read."""
  task = importlib.import_module(TASKS[task_name(config)]).from_config(
      config, training and not planning, planning)
  vocab_size = config.get("model", {}).get("vocab_size")
  if vocab_size is not None and vocab_size < task.min_vocab_size:
    raise ValueError(f"model.vocab_size={vocab_size} is too small for the task "
                     f"(needs {task.min_vocab_size})")
  return task


def checkpoint_text_task(directory: str, max_new_tokens: int, text: str, chat: bool = True,
                         thinking: bool = False, images=()) -> Task:
  """The text task of a model checkpoint directory with its own tokenizer, for sampling a reply
  to `text` (after the image files `images`): its template (in thinking mode with `thinking`),
  prompt encoding and stop ids (`TEXT_TASK`'s `checkpoint_task`)."""
  return importlib.import_module(TASKS[TEXT_TASK]).checkpoint_task(
      directory, max_new_tokens, text, chat=chat, thinking=thinking, images=images)


__all__ = ["Layout", "Prompts", "RlTask", "Task", "TASKS", "checkpoint_text_task", "make_task", "task_name", "tokenization_keys"]
