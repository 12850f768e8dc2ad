"""`train.py --dry_run`: the per-device memory of a config's compiled programs, with no weights.

The training step (and, for SD·RL, the rollout program: the sampler with trajectories over a
batch of groups) is lowered and compiled against abstract parameters on the configured mesh;
XLA's memory analysis of each executable gives arguments, outputs, temporaries and the peak per
device, checked against `device_memory_gib`.

A model with a vision tower counts it among the parameters; a task that reads images plans its
own image slots (a chat recipe's data.max_images), and `images` > 0 (train.py
--dry_run_images) plans every row of a text task with that many images at the tower's
soft-token budget, the prompt lengthened by their placeholders (`with_planned_images`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diffgemma import errors
from diffgemma.io import image_processing
from diffgemma.model import quantize
from diffgemma.model.config import ModelConfig
from diffgemma.model.transformer import VISION_SUBTREES
from diffgemma.tasks.base import ImageSlots
from diffgemma.training import loop, stages, training_state, update_step

GIB = 2 ** 30


def _bytes_per_device(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest shard)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * quantize.bits_per_value(x.dtype) // 8
  return total


def _memory(compiled, seconds: float, device_memory_gib: float) -> dict:
  mem = compiled.memory_analysis()
  report = {"arguments_gib": mem.argument_size_in_bytes / GIB,
            "outputs_gib": mem.output_size_in_bytes / GIB,
            "aliased_gib": mem.alias_size_in_bytes / GIB,
            "temporaries_gib": mem.temp_size_in_bytes / GIB,
            "code_gib": mem.generated_code_size_in_bytes / GIB,
            "compile_seconds": seconds}
  # Donated buffers are reused for the outputs (aliased): count them once.
  report["peak_gib"] = (report["arguments_gib"] + report["outputs_gib"] - report["aliased_gib"]
                        + report["temporaries_gib"] + report["code_gib"])
  report["device_memory_gib"] = device_memory_gib
  report["fits"] = report["peak_gib"] <= device_memory_gib
  return report


def _compile(fn, *args):
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - start


class _PlannedImages:
  """A text task seen through `images` image slots per row: its layout's prompt lengthened by
  their placeholders, its `image_slots` theirs; everything else the task's own."""

  def __init__(self, task, slots: ImageSlots, extra_prompt: int):
    self._task, self.image_slots = task, slots
    self.layout = dataclasses.replace(task.layout,
                                      prompt_len=task.layout.prompt_len + extra_prompt)

  def __getattr__(self, name):
    return getattr(self._task, name)


def with_planned_images(task, model_cfg: ModelConfig, images: int):
  """`task` planned with `images` images per row (module docstring), each at the vision tower's
  soft-token budget (its default_output_length, else the processor's 280) between its boi and
  eoi tokens. ConfigError (one line) for a model without a vision tower or a task that has
  image slots of its own."""
  if model_cfg.vision is None:
    raise errors.ConfigError("--dry_run_images needs a model with a vision tower (model.vision; "
                             "e.g. --config=sft_sudoku_lora:vision)")
  if task.image_slots is not None:
    raise errors.ConfigError("the task plans its own image slots (data.max_images); drop "
                             "--dry_run_images")
  v = model_cfg.vision
  settings = image_processing.ImageSettings(
      patch_size=v.patch_size, pooling_kernel_size=v.pooling_kernel_size,
      max_soft_tokens=v.default_output_length or image_processing.ImageSettings().max_soft_tokens)
  slots = ImageSlots(images, settings.max_patches, settings.patch_dim)
  return _PlannedImages(task, slots, images * (settings.max_soft_tokens + 2))


def training_program(config: ml_collections.ConfigDict, init_from: str | None = None,
                     images: int = 0):
  """(jitted update step, its abstract arguments (state, frozen, batch), setup, stage) of a
  config on its mesh, as a run would build them; nothing is allocated. With `init_from` the
  architecture is read from that checkpoint's config (no weights read); `images` > 0 plans
  that many images per row (`with_planned_images`)."""
  _, run, task, _, _ = loop.prepare_config(config, None, init_from, planning=True)
  if images:
    task = with_planned_images(task, run.model, images)
  setup = training_state.make_setup(run)
  stage = stages.make_stage(task, setup)
  frozen = None
  if setup.uses_lora:
    frozen = training_state.sharded_shapes(training_state.base_params_shape(setup), setup)
  state = training_state.abstract_state(setup, frozen)
  batch_shapes = stage.batch_shapes()
  batch_sh = update_step.batch_shardings(setup, batch_shapes)
  batch = jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), batch_shapes, batch_sh)
  step_fn = update_step.make_update_step(
      setup, stage.loss_fn, jax.tree_util.tree_map(lambda x: x.sharding, state),
      None if frozen is None else jax.tree_util.tree_map(lambda x: x.sharding, frozen),
      batch_sh, stage.update_stream)
  return step_fn, (state, frozen, batch), setup, stage


def dry_run(config: ml_collections.ConfigDict, init_from: str | None = None,
            images: int = 0) -> dict:
  """{"programs": {name: memory report}, "devices", "mesh", per-device state sizes}: the
  training step, and for SD·RL also the rollout; nothing is allocated. With `init_from` the
  architecture is read from that checkpoint's config (no weights read); `images` > 0 plans
  that many images per row (`with_planned_images`)."""
  step_fn, (state, frozen, batch), setup, stage = training_program(config, init_from, images)
  device_memory = setup.train_cfg.device_memory_gib
  programs = {"update step": _memory(*_compile(step_fn, state, frozen, batch), device_memory)}
  for name, (fn, args) in stage.planned_programs(state, frozen).items():
    programs[name] = _memory(*_compile(fn, *args), device_memory)
  run = setup.run
  pixels = batch.get("pixel_values")  # [B, I, M, D]: an SFT batch with image slots
  return {
      "devices": setup.mesh.size, "mesh": dict(setup.mesh.shape), "programs": programs,
      "batch_size": run.train.batch_size, "canvas_length": run.model.canvas_length,
      "row_tokens": batch["tokens"].shape[1] if "tokens" in batch else None,
      "images_per_row": 0 if pixels is None else pixels.shape[1],
      "image_patches": 0 if pixels is None else pixels.shape[2],
      "vision_params_gib": _bytes_per_device(
          [frozen.get(k, {}) if frozen is not None else {} for k in VISION_SUBTREES]
          + [state["params"].get(k, {}) for k in VISION_SUBTREES]) / GIB,
      "grad_accum_steps": run.train.grad_accum_steps, "remat": run.model.remat,
      "optimizer": run.optimizer.name, "optimizer_state_dtype": run.optimizer.state_dtype,
      "frozen_params_gib": 0.0 if frozen is None else _bytes_per_device(frozen) / GIB,
      "trained_params_gib": _bytes_per_device(state["params"]) / GIB,
      "optimizer_gib": _bytes_per_device(state["opt_state"]) / GIB,
      "fits": all(p["fits"] for p in programs.values()),
  }


def format_report(report: dict) -> str:
  mesh = " ".join(f"{k}={v}" for k, v in report["mesh"].items())
  rows = f" rows of {report['row_tokens']} tokens" if report["row_tokens"] else ""
  images = (f" and {report['images_per_row']} image(s) of {report['image_patches']} patches"
            if report["images_per_row"] else "")
  lines = [f"dry run: {report['devices']} devices ({mesh}), batch {report['batch_size']}"
           f"{rows}{images}, canvas {report['canvas_length']}, "
           f"grad_accum_steps {report['grad_accum_steps']}, remat {report['remat']}, optimizer "
           f"{report['optimizer']} ({report['optimizer_state_dtype']} state)"]
  for name, p in report["programs"].items():
    rows = [("arguments", p["arguments_gib"]), ("outputs", p["outputs_gib"]),
            ("  of which aliased to arguments", p["aliased_gib"]),
            ("temporaries", p["temporaries_gib"]), ("generated code", p["code_gib"]),
            ("peak per device", p["peak_gib"])]
    lines += [f"{name} (compiled in {p['compile_seconds']:.0f} s)", "| per device | GiB |",
              "|---|---|"] + [f"| {label} | {value:.2f} |" for label, value in rows]
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines.append(f"{name}: peak {p['peak_gib']:.2f} GiB per device {verdict} in "
                 f"device_memory_gib={p['device_memory_gib']:.0f}")
  lines.append(f"state per device: frozen base {report['frozen_params_gib']:.2f} GiB, trained "
               f"params {report['trained_params_gib']:.2f} GiB, optimizer "
               f"{report['optimizer_gib']:.2f} GiB (of the parameters, the vision tower "
               f"{report['vision_params_gib']:.2f} GiB)")
  return "\n".join(lines)
