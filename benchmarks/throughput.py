"""Training and sampling throughput of a config, measured side by side in one process.

  python benchmarks/throughput.py [--config=sft_sudoku] [--steps=5] [--batch_size=64]

Prints training tokens/s (and the ratio of the tiled MoE to jax.lax.ragged_dot on this machine)
and sampler tokens/s in diffusion mode against AR mode on the same weights. Absolute numbers
depend on the machine; the ratios are what to compare. Trained weights make the sampler stop
earlier (higher TPF); pass --workdir to time a trained run instead of random weights.
"""

import os
import sys
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from diffgemma import cli
from diffgemma.sampling import sampler
from diffgemma.training import loaded, run_config, training_state
from diffgemma.tasks import make_task
from sft_step import build_step  # benchmarks/sft_step.py, beside this script

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config (default sft_sudoku).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Optional trained run to sample from.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed training steps per variant.")
_BATCH = flags.DEFINE_integer("batch_size", None, "Override the batch size.")


def time_training(config, steps: int) -> float:
  """Seconds per training step after one compile step."""
  step_fn, state, batch_list = build_step(config, steps + 1)
  state, metrics = step_fn(state, None, batch_list[0])
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for batch in batch_list[1:]:
    state, metrics = step_fn(state, None, batch)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - start) / steps


def time_sampling(params, model_cfg, sampler_cfg, prompts):
  generate_fn = sampler.make_generate_fn(model_cfg, sampler_cfg)
  rng = jax.random.PRNGKey(0)
  jax.block_until_ready(generate_fn(params, prompts.prompt_NxP, prompts.valid_NxP, rng))
  start = time.perf_counter()
  out = jax.device_get(generate_fn(params, prompts.prompt_NxP, prompts.valid_NxP,
                                   jax.random.PRNGKey(1)))
  seconds = time.perf_counter() - start
  return float(np.sum(out.num_tokens)) / seconds, float(np.mean(out.tokens_per_forward))


def main(argv):
  del argv
  config = _CONFIG.value
  if _BATCH.value:
    config.batch_size = _BATCH.value
  task = make_task(config)
  tokens_per_step = config.batch_size * task.layout.seq_len
  print(f"config: batch {config.batch_size}, {tokens_per_step} tokens/step, "
        f"moe_impl={config.model.moe_impl}")

  seconds = {}
  for impl in ("tiled", "ragged_dot"):
    variant = config.copy_and_resolve_references()
    variant.model.moe_impl = impl
    seconds[impl] = time_training(variant, _STEPS.value)
    print(f"train moe_impl={impl:10s}: {seconds[impl]:.3f} s/step, "
          f"{tokens_per_step / seconds[impl]:,.0f} tokens/s")
  print(f"train ratio tiled/ragged_dot speed: {seconds['ragged_dot'] / seconds['tiled']:.2f}x")

  if _WORKDIR.value:
    run = loaded.load_run(_WORKDIR.value)
    params, model_cfg, sampler_cfg = run.params, run.model_cfg, run.sampler_cfg
  else:
    run_cfg = run_config.build(config)
    model_cfg, sampler_cfg = run_cfg.model, run_cfg.sampler.with_stops(task.stop_token_ids)
    params = training_state.init_state(training_state.make_setup(run_cfg))["params"]
  prompts = task.eval_prompts().take(slice(0, config.eval.batch_size))
  diffusion_tps, tpf = time_sampling(params, model_cfg, sampler_cfg, prompts)
  ar_tps, _ = time_sampling(params, model_cfg, sampler_cfg.replace(mode="ar"), prompts)
  print(f"sample diffusion: {diffusion_tps:,.0f} tokens/s (TPF {tpf:.2f}, batch {len(prompts)})")
  print(f"sample AR       : {ar_tps:,.0f} tokens/s")
  print(f"sample ratio diffusion/AR: {diffusion_tps / ar_tps:.2f}x")


if __name__ == "__main__":
  cli.run(main, sys.argv if any(a.startswith("--config=") for a in sys.argv)
           else sys.argv + ["--config=sft_sudoku"])
