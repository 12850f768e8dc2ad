"""The seams a new stage, task or sampler variant plugs into: the stage registry and protocol,
the task split (`Task` / `RlTask`) and its headline metric, and `--sampler.KEY=VALUE`."""

import dataclasses
import inspect

import ml_collections
import pytest

from diffgemma import cli
from diffgemma.sampling import sampler
from diffgemma.tasks import base as task_base
from diffgemma.tools import compare
from diffgemma.training import stages
from diffgemma.training.stages import base as stage_base
from diffgemma.training.stages import sdrl, sft


def config(**sections):
  return ml_collections.ConfigDict(sections)


@pytest.mark.parametrize("sections, expected", [
    (dict(), "sft"),  # a config saved before `stage` existed, without an sdrl section
    (dict(sdrl=dict(group_size=2)), "sdrl"),  # ... with one
    (dict(stage="sft"), "sft"),
    (dict(stage="sdrl", sdrl=dict(group_size=2)), "sdrl"),
])
def test_stage_name(sections, expected):
  assert stages.stage_name(config(**sections)) == expected
  assert stages.stage_class(config(**sections)).name == expected


@pytest.mark.parametrize("sections, needle", [
    (dict(stage="distill"), "unknown stage 'distill'"),
    (dict(stage="sft", sdrl=dict(group_size=2)), "has a 'sdrl' section but stage='sft'"),
])
def test_stage_name_refuses(sections, needle):
  with pytest.raises(ValueError, match=needle):
    stages.stage_name(config(**sections))


def protocol_members():
  hints = set(getattr(stage_base.Stage, "__annotations__", {}))
  methods = {n for n, v in vars(stage_base.Stage).items()
             if callable(v) or isinstance(v, staticmethod)} - set(dir(object))
  return (hints | methods) - {"_is_protocol", "_is_runtime_protocol", "__init__",
                              "__subclasshook__", "__class_getitem__", "__init_subclass__"}


@pytest.mark.parametrize("cls", [sft.SftStage, sdrl.SdrlStage])
def test_every_registered_stage_satisfies_the_protocol(cls):
  members = {m for m in protocol_members() if not m.startswith("_")}
  assert {"name", "update_stream", "requires_init_from", "loss_fn", "next_batch",
          "planned_programs", "settings"} <= members
  missing = [m for m in members if not hasattr(cls, m)]
  assert not missing, f"{cls.__name__} lacks {missing}"
  for m in members:  # methods take the protocol's arguments
    theirs, ours = getattr(stage_base.Stage, m, None), getattr(cls, m)
    if callable(theirs) and callable(ours):
      params = lambda f: [p for p in inspect.signature(f).parameters if p != "self"]
      assert params(theirs) == params(ours), m  # a staticmethod may drop `self`
  assert [cls.__module__] == [stages.STAGES[cls.name][0]]


def test_sdrl_needs_init_from_and_sft_does_not():
  assert sdrl.SdrlStage.requires_init_from and not sft.SftStage.requires_init_from


def test_an_sft_only_task_implements_no_rl_method():
  """A Task subclass with only the SFT / evaluation / text methods can be built; RlTask adds
  exactly the SD·RL methods."""
  abstract = {n for n in dir(task_base.Task)
              if getattr(getattr(task_base.Task, n), "__isabstractmethod__", False)}
  rl_abstract = {n for n in dir(task_base.RlTask)
                 if getattr(getattr(task_base.RlTask, n), "__isabstractmethod__", False)}
  assert rl_abstract - abstract == {"rollout_prompts", "reward"}
  assert not {"rollout_prompts", "reward", "token_weights"} & set(vars(task_base.Task))

  class Echo(task_base.Task):
    layout = task_base.Layout(2, 1, 2)
    train_batches = eval_prompts = load_eval_file = score = lambda *a, **k: None
    prompt_from_text = prompt_text = reply_text = token_strings = lambda *a, **k: None

  assert Echo().headline_metric == "accuracy"
  assert not isinstance(Echo(), task_base.RlTask)


def test_registered_tasks_declare_a_headline_they_score():
  from diffgemma.tasks import chat, sudoku  # the tasks themselves (test code may name them)

  assert sudoku.SudokuTask.headline_metric == "puzzle_accuracy"
  assert chat.ChatTask.headline_metric == "accuracy"
  assert issubclass(sudoku.SudokuTask, task_base.RlTask)
  assert issubclass(chat.ChatTask, task_base.RlTask)


def test_split_section_overrides():
  rest, found = cli.split_section_overrides(
      ["eval.py", "--workdir=w", "--sampler.entropy_bound=0.3", "--sampler.mode=ar",
       "--samplers=x"], "sampler")
  assert rest == ["eval.py", "--workdir=w", "--samplers=x"]
  assert found == {"entropy_bound": "0.3", "mode": "ar"}


def test_sampler_overrides_are_typed_by_their_field():
  parsed = cli.typed_overrides({"entropy_bound": "0.3", "max_denoising_steps": "7",
                                "fused_step": "true", "mode": "ar", "stop_token_ids": "4,9"},
                               sampler.SamplerConfig, "sampler")
  assert parsed == {"entropy_bound": 0.3, "max_denoising_steps": 7, "fused_step": True,
                    "mode": "ar", "stop_token_ids": (4, 9)}
  assert type(parsed["entropy_bound"]) is float and type(parsed["max_denoising_steps"]) is int
  cfg = sampler.SamplerConfig().replace(**parsed)
  assert dataclasses.asdict(cfg)["entropy_bound"] == 0.3
  with pytest.raises(ValueError, match="unknown sampler key 'entropy'"):
    cli.typed_overrides({"entropy": "1"}, sampler.SamplerConfig, "sampler")
  with pytest.raises(ValueError, match="--sampler.max_denoising_steps='many' is not a int"):
    cli.typed_overrides({"max_denoising_steps": "many"}, sampler.SamplerConfig, "sampler")
  with pytest.raises(ValueError, match="not a bool"):
    cli.typed_overrides({"fused_step": "yes please"}, sampler.SamplerConfig, "sampler")


def heldout_run(name, result):
  return compare.Run(workdir=f"/runs/{name}", config={"optimizer.lr": name}, series={},
                     minutes=1.0, heldout={"count": result})


def test_heldout_table_leads_with_each_results_headline_metric():
  """A chat result's `accuracy` (named by eval.py) is shown, as Sudoku's puzzle accuracy is;
  results written before eval.py named it fall back to the legacy keys."""
  chat_new = {"accuracy": 0.25, "tokens_per_forward": 3.5, "steps_per_canvas": 9.0,
              "headline_metric": "accuracy"}
  chat_old = {"accuracy": 0.5, "tokens_per_forward": 2.0, "steps_per_canvas": 12.0}
  header, rows = compare.table([heldout_run("a", chat_new), heldout_run("b", chat_old)])
  assert header[:5] == ["run", "optimizer.lr", "count: accuracy", "count: tokens_per_forward",
                        "count: steps_per_canvas"]
  assert [r[2] for r in rows] == ["0.500", "0.250"]  # ranked best first by the headline
  sudoku = {"puzzle_accuracy": 0.75, "cell_accuracy": 0.95, "blank_cell_accuracy": 0.9,
            "tokens_per_forward": 9.0}
  assert compare.headline_metric(sudoku) == "puzzle_accuracy"
  assert compare.heldout_metrics([heldout_run("s", sudoku)], "count") == [
      "puzzle_accuracy", "blank_cell_accuracy", "tokens_per_forward"]


def test_ties_on_the_headline_are_broken_by_the_next_columns():
  """A short proxy budget leaves every point at 0 puzzles: blank cells rank them, then TPF, then
  steps per canvas (lower is better); a run without the headline goes last."""
  def sudoku(puzzles, blank, tpf, spc):
    return {"puzzle_accuracy": puzzles, "blank_cell_accuracy": blank, "tokens_per_forward": tpf,
            "steps_per_canvas": spc, "headline_metric": "puzzle_accuracy"}

  runs = [heldout_run("low", sudoku(0.0, 0.55, 9.0, 9.0)),
          heldout_run("none", {"tokens_per_forward": 20.0}),
          heldout_run("slow", sudoku(0.0, 0.60, 9.0, 12.0)),
          heldout_run("best", sudoku(0.01, 0.50, 5.0, 20.0)),
          heldout_run("fast", sudoku(0.0, 0.60, 9.0, 10.0))]
  _, rows = compare.table(runs)
  assert [r[0] for r in rows] == ["best", "fast", "slow", "low", "none"]

  # A run missing a tie-breaker ranks after those that have it, for a lower-is-better column
  # (steps per canvas) as for a higher-is-better one.
  no_spc = sudoku(0.0, 0.60, 9.0, 10.0)
  del no_spc["steps_per_canvas"]
  runs = [heldout_run("no_spc", no_spc), heldout_run("fast", sudoku(0.0, 0.60, 9.0, 10.0))]
  no_blank = sudoku(0.0, 0.60, 9.0, 10.0)
  del no_blank["blank_cell_accuracy"]
  runs += [heldout_run("no_blank", no_blank)]
  _, rows = compare.table(runs)
  assert [r[0] for r in rows] == ["fast", "no_spc", "no_blank"]
