"""SD·RL (DESIGN.md §5): online sampler distillation + reinforcement learning after SFT.

One iteration of the loop (`train`):
  1. rollout: G samples per prompt from the current parameters with the production sampler
     (`sampler.generate`, jitted, `record_trajectory=True`): every step's input canvas and
     argmax, and which rows ran it;
  2. rewards from a task verifier (`diffgemma.rewards`), group-relative advantages
     A = (r - mean_G) / (std_G + eps) and from them each trajectory's weight (`advantages`);
  3. states: a few steps of each canvas's trajectory (`select_steps`); the self-conditioning
     input the sampler had at each is rebuilt by replaying its decoder steps on the recorded
     canvases (`replay`; the recorder keeps canvases, not the [C, V] self-conditioning logits);
  4. `updates_per_rollout` optimizer steps on the weighted loss: from each state, the decoder's
     CE toward the trajectory's final canvas, times the trajectory's weight (`sdrl_loss`), plus
     an optional anchor.
Modes (`sdrl.mode`): "both" (the design), "distill" (every advantage 1: plain self-distillation
toward the model's own final canvases), "rl" (advantage-weighted denoising CE on forward-process
corruptions of the final canvas instead of trajectory states).

The checkpointed state has the SFT trainer's layout (step, params, opt_state, rng), so eval.py and
sample.py read an SD·RL workdir as any training run. A step is one optimizer update; rollouts
happen at multiples of `updates_per_rollout`, and checkpoints only there, so a resumed run redraws
exactly the rollouts of an uninterrupted one.

Shape suffixes: B rollout rows (prompts x G), G group size, P prompt, K canvases, N max denoising
steps, M states per canvas trajectory, U = K * M * B state rows, C canvas, V vocab, D hidden.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from tqdm import tqdm

from diffgemma import (
  checkpointing,
  config_checks,
  data,
  diffusion,
  losses,
  model,
  rewards,
  run_guard,
  sampler,
  sudoku,
  trainer,
  workdir_lock,
)
from diffgemma.config import ModelConfig
from diffgemma.tb_writer import ScalarWriter

MODES = ("both", "distill", "rl")
STATE_SELECTIONS = ("uniform", "first_k", "last_k", "all")
ADVANTAGE_NORMS = ("group_std", "group_mean", "none")
ANCHORS = ("none", "kl", "sft")
CELL_WEIGHTINGS = ("none", "consistent")
ROLLOUT_STATS = ("tokens_per_forward", "steps_per_canvas", "num_tokens")
# The config keys `trainer.make_optimizer` reads.
OPTIMIZER_KEYS = ("optimizer", "num_train_steps", "freeze_router", "lora")
# Independent random streams of one step, folded into the run's key.
_ROLLOUT_STREAM, _STATES_STREAM, _UPDATE_STREAM = range(3)


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  """Rollout prompts: generated Sudoku puzzles, givens uniform in [min_givens, max_givens]."""

  seed: int = 7
  min_givens: int = 28
  max_givens: int = 46


@dataclasses.dataclass(frozen=True)
class SdrlConfig:
  """Every SD·RL choice (config section `sdrl`; see configs/sdrl_sudoku.py for the values).

  group_size: G samples per prompt; prompts_per_rollout prompts per rollout (B = their product).
  updates_per_rollout: optimizer steps on one rollout batch before the next rollout.
  states_per_trajectory: M states per canvas trajectory ("rl": M corruptions of its final canvas).
  state_selection: "uniform" (M steps drawn uniformly, with replacement, from the steps the row
    ran), "first_k" (its first M steps: the noisiest states, where a canvas's step count is
    decided), "last_k" (its last M steps), "all" (every step it ran; M = max_denoising_steps).
  advantage_norm: "group_std" (r - mean_G) / (std_G + advantage_eps), "group_mean" r - mean_G,
    "none" r itself (with a 0/1 reward: distillation toward the correct samples only).
  negative_advantage_weight: negative advantages are multiplied by it (0 drops them).
  advantage_clip: |A| is clipped to it; 0 = no clipping.
  reward_weight: lambda in the state weight A + lambda * r: reward-weighted distillation on top
    of the advantage, so a group whose samples all succeed (A = 0) still distils its
    trajectories toward fewer steps; 0 = the advantage alone.
  cell_weighting: "none" (every target cell counts) or "consistent" (Sudoku: only the cells of
    the final grid that the verifier finds consistent, `rewards.consistent_cells`, are
    distilled; an unsolved grid's conflicting cells are not pushed toward).
  anchor: "none"; "kl" KL(reference || model) of the decoder on the trained states, the
    reference being the frozen initial parameters; "sft" the SFT loss on task data
    (`config.data`, `anchor_batch_size` examples per update). Weighted by anchor_weight.
  """

  mode: str = "both"
  group_size: int = 8
  prompts_per_rollout: int = 4
  updates_per_rollout: int = 1
  states_per_trajectory: int = 4
  state_selection: str = "uniform"
  advantage_norm: str = "group_std"
  advantage_eps: float = 1e-6
  negative_advantage_weight: float = 1.0
  advantage_clip: float = 0.0
  reward_weight: float = 0.0
  cell_weighting: str = "none"
  anchor: str = "none"
  anchor_weight: float = 0.0
  anchor_batch_size: int = 16
  reward: rewards.RewardConfig = dataclasses.field(default_factory=rewards.RewardConfig)
  prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)

  def __post_init__(self):
    for name, value, choices in (("mode", self.mode, MODES),
                                 ("state_selection", self.state_selection, STATE_SELECTIONS),
                                 ("advantage_norm", self.advantage_norm, ADVANTAGE_NORMS),
                                 ("cell_weighting", self.cell_weighting, CELL_WEIGHTINGS),
                                 ("anchor", self.anchor, ANCHORS)):
      if value not in choices:
        raise ValueError(f"unknown sdrl.{name} {value!r}; choose one of {choices}")
    for name in ("group_size", "prompts_per_rollout", "updates_per_rollout",
                 "states_per_trajectory", "anchor_batch_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"sdrl.{name} must be positive, got {getattr(self, name)}")
    if self.group_size < 2 and self.mode != "distill" and self.advantage_norm != "none":
      raise ValueError("group-relative advantages need sdrl.group_size >= 2")
    if self.cell_weighting == "consistent" and self.reward.name != "sudoku":
      raise ValueError("sdrl.cell_weighting='consistent' needs reward.name='sudoku'")
    if self.advantage_eps <= 0:
      raise ValueError("sdrl.advantage_eps must be positive")
    for name in ("negative_advantage_weight", "advantage_clip", "reward_weight", "anchor_weight"):
      if getattr(self, name) < 0:
        raise ValueError(f"sdrl.{name} must be >= 0, got {getattr(self, name)}")

  @property
  def rows(self) -> int:
    return self.group_size * self.prompts_per_rollout


def is_sdrl_config(config: ml_collections.ConfigDict) -> bool:
  return "sdrl" in config


def sdrl_config(config: ml_collections.ConfigDict) -> SdrlConfig:
  section = config.sdrl.to_dict()
  nested = {"reward": rewards.RewardConfig(**section.pop("reward")),
            "prompts": PromptConfig(**section.pop("prompts"))}
  section.pop("rollout_sampler")
  return SdrlConfig(**section, **nested)


def rollout_sampler_config(config: ml_collections.ConfigDict) -> sampler.SamplerConfig:
  """The sampler of the rollouts (`sdrl.rollout_sampler`), always recording trajectories."""
  return sampler.SamplerConfig(**config.sdrl.rollout_sampler.to_dict()).replace(
      record_trajectory=True, mode=sampler.DIFFUSION)


def num_states(cfg: SdrlConfig, sampler_cfg: sampler.SamplerConfig) -> int:
  """M: states per canvas trajectory."""
  if cfg.state_selection == "all" and cfg.mode != "rl":
    return sampler_cfg.max_denoising_steps
  return cfg.states_per_trajectory


def validate_config(config: ml_collections.ConfigDict) -> None:
  """The SFT checks, then every SD·RL piece, so a bad value fails before any work starts."""
  trainer.validate_config(config)
  if trainer.lora_config(config).enabled:
    raise ValueError("SD·RL trains the full model; set lora.enabled=False")
  cfg = sdrl_config(config)
  rollout_sampler_config(config)
  sudoku.check_givens_range(cfg.prompts.min_givens, cfg.prompts.max_givens)
  # Checkpoints (and the end) fall between rollouts, so a resumed run redraws the same ones.
  for name in ("checkpoint_every", "num_train_steps"):
    if config[name] % cfg.updates_per_rollout:
      raise ValueError(f"{name}={config[name]} must be a multiple of "
                       f"sdrl.updates_per_rollout={cfg.updates_per_rollout}")


# ----------------------------------------------------------------------------- advantages


def advantages(rewards_B, cfg: SdrlConfig):
  """Per-row state weights [B] from rewards [B] of groups of G adjacent rows: the advantage
  (normalised, clipped, negatives scaled) plus reward_weight * r; 1 in "distill" mode."""
  r_PxG = jnp.asarray(rewards_B, jnp.float32).reshape(-1, cfg.group_size)
  if cfg.mode == "distill":
    return jnp.ones(r_PxG.size, jnp.float32)
  centred_PxG = r_PxG - jnp.mean(r_PxG, axis=1, keepdims=True)
  if cfg.advantage_norm == "group_std":
    a_PxG = centred_PxG / (jnp.std(r_PxG, axis=1, keepdims=True) + cfg.advantage_eps)
  elif cfg.advantage_norm == "group_mean":
    a_PxG = centred_PxG
  else:
    a_PxG = r_PxG
  if cfg.advantage_clip:
    a_PxG = jnp.clip(a_PxG, -cfg.advantage_clip, cfg.advantage_clip)
  a_PxG = jnp.where(a_PxG < 0, cfg.negative_advantage_weight * a_PxG, a_PxG)
  return (a_PxG + cfg.reward_weight * r_PxG).reshape(-1)


# ----------------------------------------------------------------------------- states


def select_steps(num_steps_KxB, rng, cfg: SdrlConfig, num: int):
  """Which recorded steps become training states: int32 [K, M=num, B], -1 = none.

  num_steps_KxB: steps each row ran on each canvas (0: the row had ended before it).
  """
  k, b = num_steps_KxB.shape
  n_Kx1xB = num_steps_KxB[:, None, :]
  m_1xMx1 = jnp.arange(num)[None, :, None]
  if cfg.state_selection == "uniform":
    u_KxMxB = jax.random.uniform(rng, (k, num, b))
    step_KxMxB = jnp.floor(u_KxMxB * n_Kx1xB).astype(jnp.int32)
    return jnp.where(n_Kx1xB > 0, jnp.minimum(step_KxMxB, n_Kx1xB - 1), -1)
  if cfg.state_selection == "last_k":
    step_KxMxB = n_Kx1xB - 1 - m_1xMx1
  else:  # "first_k", "all": the first M steps the row ran
    step_KxMxB = jnp.where(m_1xMx1 < n_Kx1xB, m_1xMx1, -1)
  return jnp.maximum(step_KxMxB, -1).astype(jnp.int32)


def _self_cond_embedding(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                         state: sampler.DenoiseState):
  """The self-conditioning embedding [B, C, D] the decoder sees in `state` (zeros at step 0)."""
  if sampler_cfg.fused_step:
    emb_BxCxD = state.self_cond_embedding_BxCxD
  else:
    emb_BxCxD = model.self_conditioning_embedding(params, state.self_cond_BxCxV, model_cfg)
  return jnp.where(state.step > 0, emb_BxCxD, 0).astype(model_cfg.compute_dtype)


def replay(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig, cache,
           canvas_NxBxC, valid_NxB, rng, pick_MxB=None):
  """Re-run the sampler's denoising steps (`sampler.denoising_step`) on recorded input canvases.

  Step n feeds the recorded canvas n with the self-conditioning the replay itself carries from
  step n-1, exactly as the sampler did; rows not valid at a step are frozen, as finished rows.
  Step n draws with fold_in(rng, n), the sampler's per-step key when `rng` is its loop key.
  Returns {"argmax": [N, B, C] each step's argmax (the sampler's recorded argmax when the replay
  is faithful), "canvas": [N, B, C] each step's output canvas (the next step's input, with the
  sampler's key), "self_cond": [M, B, C, D] the self-conditioning embedding at step pick[m, b]}.
  """
  n_max, b, c = canvas_NxBxC.shape
  num_picks = 0 if pick_MxB is None else pick_MxB.shape[0]
  if pick_MxB is None:
    pick_MxB = jnp.zeros((0, b), jnp.int32)
  state = sampler.init_denoise_state(params, model_cfg, sampler_cfg, rng, b)
  carry = {"state": state,
           "argmax": jnp.zeros((n_max, b, c), jnp.int32),
           "canvas": jnp.zeros((n_max, b, c), jnp.int32),
           "self_cond": jnp.zeros((num_picks, b, c, model_cfg.hidden_size),
                                  model_cfg.compute_dtype)}
  num_run = jnp.max(jnp.sum(valid_NxB, axis=0))

  def body(carry):
    state = carry["state"]
    n = state.step
    state = state._replace(canvas_BxC=canvas_NxBxC[n], finished_B=~valid_NxB[n])
    picked_MxBx1x1 = (pick_MxB == n)[:, :, None, None]
    self_cond = jnp.where(picked_MxBx1x1,
                          _self_cond_embedding(params, model_cfg, sampler_cfg, state)[None],
                          carry["self_cond"])
    new_state, _ = sampler.denoising_step(params, model_cfg, sampler_cfg, cache, state,
                                          jax.random.fold_in(rng, n))
    put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, n, 0)
    return {"state": new_state, "argmax": put(carry["argmax"], new_state.argmax_BxC),
            "canvas": put(carry["canvas"], new_state.canvas_BxC), "self_cond": self_cond}

  carry = jax.lax.while_loop(lambda carry: carry["state"].step < num_run, body, carry)
  return {"argmax": carry["argmax"], "canvas": carry["canvas"], "self_cond": carry["self_cond"]}


def context_tokens(tokens_BxL, model_cfg: ModelConfig):
  """The committed canvases a later canvas is conditioned on: all but the last, [B, (K-1)*C]."""
  return tokens_BxL[:, :tokens_BxL.shape[1] - model_cfg.canvas_length]


def encode_context(params, model_cfg: ModelConfig, prompt_BxP, prompt_valid_BxP, context_BxT):
  """The encoder cache of prompt + committed canvases (slots as the sampler's)."""
  b, p = prompt_BxP.shape
  cache = model.init_cache(model_cfg, b, p + context_BxT.shape[1] + model_cfg.canvas_length)
  tokens = jnp.concatenate([prompt_BxP, context_BxT], axis=1).astype(jnp.int32)
  valid = jnp.concatenate([prompt_valid_BxP, jnp.ones(context_BxT.shape, bool)], axis=1)
  return model.encode(params, model_cfg, tokens, cache, valid)[1]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def prepare_states(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                   cfg: SdrlConfig, prompt_BxP, prompt_valid_BxP, rollout: dict, weight_B, rng,
                   cell_weight_BxL=None):
  """The training batch of one rollout (jitted; configs static).

  rollout: `generate`'s output with a trajectory. Returns a dict: prompt_BxP, prompt_valid_BxP,
  context_BxT, weight_B; per state row u = (k * M + m) * B + b: row_U, prefix_len_U,
  target_UxC (canvas k's final argmax), valid_U (the state exists), step_U (its step, -1 for
  "rl"); trajectory modes also canvas_UxC and self_cond_UxCxD (its decoder input). Plus scalars
  replay_agreement (share of replayed steps whose argmax canvas equals the recorded one) and
  state_position (mean step / steps of the canvas, of valid states). With `cell_weight_BxL`
  (a weight per generated token), also cell_weight_UxC: each state's target cells' weights.
  """
  traj = rollout["trajectory"]
  k_max, _, b, c = traj["canvas"].shape
  p = prompt_BxP.shape[1]
  num = num_states(cfg, sampler_cfg)
  num_steps_KxB = jnp.sum(traj["valid"], axis=1).astype(jnp.int32)
  last_KxBx1 = jnp.maximum(num_steps_KxB - 1, 0)[:, :, None]
  final_KxBxC = jnp.take_along_axis(traj["argmax"], last_KxBx1[:, None], axis=1)[:, 0]
  batch = {"prompt_BxP": prompt_BxP, "prompt_valid_BxP": prompt_valid_BxP,
           "context_BxT": context_tokens(rollout["tokens"], model_cfg),
           "weight_B": weight_B,
           "row_U": jnp.tile(jnp.arange(b, dtype=jnp.int32), k_max * num),
           "prefix_len_U": jnp.repeat(p + c * jnp.arange(k_max, dtype=jnp.int32), num * b),
           "target_UxC": jnp.broadcast_to(final_KxBxC[:, None], (k_max, num, b, c)).reshape(-1, c)}
  if cell_weight_BxL is not None:
    weight_KxBxC = jnp.asarray(cell_weight_BxL, jnp.float32).reshape(b, k_max, c).transpose(1, 0, 2)
    batch["cell_weight_UxC"] = jnp.broadcast_to(weight_KxBxC[:, None],
                                                (k_max, num, b, c)).reshape(-1, c)
  if cfg.mode == "rl":
    valid_KxMxB = jnp.broadcast_to((num_steps_KxB > 0)[:, None], (k_max, num, b))
    batch.update(valid_U=valid_KxMxB.reshape(-1), step_U=jnp.full(k_max * num * b, -1),
                 replay_agreement=jnp.ones(()), state_position=jnp.zeros(()))
    return batch
  pick_KxMxB = select_steps(num_steps_KxB, rng, cfg, num)
  cache = encode_context(params, model_cfg, prompt_BxP, prompt_valid_BxP, batch["context_BxT"])
  canvases, self_conds, agree, ran = [], [], 0, 0
  for k in range(k_max):
    canvas_cache = dict(cache, end=jnp.asarray(p + k * c, jnp.int32))
    out = replay(params, model_cfg, sampler_cfg, canvas_cache, traj["canvas"][k],
                 traj["valid"][k], jax.random.fold_in(rng, k), pick_KxMxB[k])
    same_NxB = jnp.all(out["argmax"] == traj["argmax"][k], axis=-1)
    agree += jnp.sum(same_NxB & traj["valid"][k])
    ran += jnp.sum(traj["valid"][k])
    index_MxBx1 = jnp.maximum(pick_KxMxB[k], 0)[:, :, None]
    canvases.append(jnp.take_along_axis(traj["canvas"][k], index_MxBx1, axis=0))
    self_conds.append(out["self_cond"])
  valid_KxMxB = pick_KxMxB >= 0
  position_KxMxB = pick_KxMxB / jnp.maximum(num_steps_KxB[:, None], 1)
  batch.update(
      canvas_UxC=jnp.stack(canvases).reshape(-1, c),
      self_cond_UxCxD=jnp.stack(self_conds).reshape(k_max * num * b, c, -1),
      valid_U=valid_KxMxB.reshape(-1), step_U=pick_KxMxB.reshape(-1),
      replay_agreement=agree / jnp.maximum(ran, 1),
      state_position=losses.masked_mean(position_KxMxB, valid_KxMxB))
  return batch


# ----------------------------------------------------------------------------- loss


def _take_rows(cache, row_U):
  """The cache of each state row's rollout row."""
  take = lambda x: x[row_U]
  return {"layers": jax.tree_util.tree_map(take, cache["layers"]), "valid": take(cache["valid"]),
          "end": cache["end"]}


def _decoder_logits(params, model_cfg: ModelConfig, cfg: SdrlConfig, loss_cfg, batch, rng,
                    inputs=None):
  """Decoder logits [U, C, V] on the state rows, and the inputs that produced them.

  Trajectory modes: the recorded canvas and self-conditioning embedding. "rl": the final canvas
  corrupted at t ~ U(t_eps, 1), self-conditioned as in SFT. `inputs` (from a previous call)
  replays the same inputs, e.g. for the anchor's reference model.
  """
  cache = encode_context(params, model_cfg, batch["prompt_BxP"], batch["prompt_valid_BxP"],
                         batch["context_BxT"])
  cache_U = _take_rows(cache, batch["row_U"])
  prefix_U = batch["prefix_len_U"]
  if cfg.mode != "rl":
    return model.decode(params, model_cfg, batch["canvas_UxC"], cache_U, prefix_U, None, None,
                        batch["self_cond_UxCxD"]), None
  if inputs is not None:
    noisy_UxC, sc_logits, sc_mask_U = inputs
    return model.decode(params, model_cfg, noisy_UxC, cache_U, prefix_U, sc_logits,
                        sc_mask_U), inputs
  t_rng, noise_rng = jax.random.split(rng)
  target_UxC = batch["target_UxC"]
  t_U = diffusion.sample_noise_level(t_rng, target_UxC.shape[0], loss_cfg.t_eps)
  noisy_UxC = diffusion.corrupt(noise_rng, target_UxC, t_U, model_cfg.vocab_size,
                                loss_cfg.noise_schedule)
  logits, sc_logits, sc_mask_U = losses.self_conditioned_logits(
      params, model_cfg, noisy_UxC, cache_U, prefix_U, loss_cfg.self_conditioning_prob)
  return logits, (noisy_UxC, sc_logits, sc_mask_U)


def sdrl_loss(params, model_cfg: ModelConfig, cfg: SdrlConfig, loss_cfg: losses.LossConfig,
              batch: dict, rng, reference_params=None, anchor_batch=None):
  """(loss, metrics): weighted decoder CE toward the final canvases, plus the anchor.

  loss = sum_u w[row_u] * CE_u / #valid states + anchor_weight * anchor, with w the rows'
  weights (`advantages`) and CE_u the mean over the canvas of the decoder's CE toward state u's
  final canvas (each cell times its cell_weight_UxC when the batch has one).
  """
  decode_rng, anchor_rng = jax.random.split(rng)
  logits_UxCxV, inputs = _decoder_logits(params, model_cfg, cfg, loss_cfg, batch, decode_rng)
  target_UxC, valid_U = batch["target_UxC"], batch["valid_U"]
  ce_UxC = losses.cross_entropy(logits_UxCxV, target_UxC)
  if "cell_weight_UxC" in batch:  # masked cells count as zero, not renormalised away
    ce_UxC = ce_UxC * batch["cell_weight_UxC"]
  ce_U = jnp.mean(ce_UxC, axis=-1)
  weight_U = batch["weight_B"][batch["row_U"]] * valid_U
  num_valid = jnp.maximum(jnp.sum(valid_U), 1)
  policy_loss = jnp.sum(weight_U * ce_U) / num_valid
  correct_UxC = jnp.argmax(logits_UxCxV, axis=-1) == target_UxC
  metrics = {"policy_loss": policy_loss, "state_ce": losses.masked_mean(ce_U, valid_U),
             "state_token_accuracy": losses.masked_mean(jnp.mean(correct_UxC, -1), valid_U)}
  anchor = jnp.zeros(())
  if cfg.anchor == "kl":
    ref_logits_UxCxV, _ = _decoder_logits(reference_params, model_cfg, cfg, loss_cfg, batch,
                                          decode_rng, inputs)
    ref_logp = jax.nn.log_softmax(jax.lax.stop_gradient(ref_logits_UxCxV), axis=-1)
    logp = jax.nn.log_softmax(logits_UxCxV, axis=-1)
    kl_U = jnp.mean(jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1), axis=-1)
    anchor = losses.masked_mean(kl_U, valid_U)
  elif cfg.anchor == "sft":
    anchor, _ = losses.sft_loss(params, model_cfg, loss_cfg, anchor_batch, anchor_rng)
  if cfg.anchor != "none":
    metrics["anchor"] = anchor
  total = policy_loss + cfg.anchor_weight * anchor
  metrics["loss"] = total
  return total, metrics


def stream_key(state_rng, stream: int, step):
  """The key of one of a step's independent random streams (rollout, states, update)."""
  return jax.random.fold_in(jax.random.fold_in(state_rng, stream), step)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """The optimizer as a static (hashable) argument: `config.optimizer` and the schedule length,
  as JSON, so equal configs share one compiled update step."""

  config_json: str

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> OptimizerSpec:
    keys = [k for k in OPTIMIZER_KEYS if k in config]
    return cls(ml_collections.ConfigDict({k: config[k] for k in keys}).to_json())

  def build(self):
    """(optax transformation, learning-rate schedule), as `trainer.make_optimizer`."""
    return trainer.make_optimizer(ml_collections.ConfigDict(json.loads(self.config_json)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4), donate_argnums=0)
def update_step(state, model_cfg: ModelConfig, cfg: SdrlConfig, loss_cfg: losses.LossConfig,
                optimizer: OptimizerSpec, batch, reference_params, anchor_batch):
  """One optimizer step on `sdrl_loss`: (state, metrics). The step's randomness is a function of
  the state's key and step, so a resumed run draws what an uninterrupted one would."""
  tx, schedule = optimizer.build()
  rng = stream_key(state["rng"], _UPDATE_STREAM, state["step"])
  grad_fn = jax.value_and_grad(sdrl_loss, has_aux=True)
  (_, metrics), grads = grad_fn(state["params"], model_cfg, cfg, loss_cfg, batch, rng,
                                reference_params, anchor_batch)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  metrics["grad_norm"] = optax.tree.norm(grads)
  metrics["learning_rate"] = schedule(state["step"])
  return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
          "opt_state": opt_state, "rng": state["rng"]}, metrics


# ----------------------------------------------------------------------------- the loop


def rollout_prompts(cfg: SdrlConfig, iteration: int, prompt_format: str):
  """Iteration `iteration`'s prompts, each repeated G times: (prompt_BxP, valid_BxP, task).

  Puzzle i of the stream is a pure function of (seed, i): a resumed run sees the same prompts.
  """
  p = cfg.prompts
  source = data.CurriculumSudokuSource(
      p.seed, cfg.prompts_per_rollout, iteration + 1,
      data.GivensCurriculum(p.min_givens, p.max_givens, p.min_givens, p.max_givens, 0))
  first = iteration * cfg.prompts_per_rollout
  records = [source[i] for i in range(first, first + cfg.prompts_per_rollout)]
  repeat = lambda key: np.repeat(np.stack([r[key] for r in records]), cfg.group_size, axis=0)
  task = {"puzzle": repeat("puzzle"), "solution": repeat("solution")}
  task["target"] = data.solution_tokens(task["solution"])
  arrays = data.eval_arrays(task["puzzle"], prompt_format)
  return arrays["prompt"], arrays["valid"], task


def _rollout_metrics(rollout: dict, rewarded: dict, weight_B, cfg: SdrlConfig) -> dict:
  reward_PxG = rewarded["reward"].reshape(-1, cfg.group_size)
  return {
      "rollout/reward_mean": float(np.mean(rewarded["reward"])),
      "rollout/reward_std": float(np.std(rewarded["reward"])),
      "rollout/group_reward_std": float(np.mean(np.std(reward_PxG, axis=1))),
      "rollout/score_mean": float(np.mean(rewarded["score"])),
      "rollout/accuracy": float(np.mean(rewarded["correct"])),
      "rollout/tokens_per_forward": float(np.mean(rollout["tokens_per_forward"])),
      "rollout/steps_per_canvas": float(np.mean(rollout["steps_per_canvas"])),
      "rollout/weight_mean": float(np.mean(weight_B)),
  }


def _load_reference(config, cfg: SdrlConfig):
  """The frozen initial parameters, needed only by the KL anchor."""
  if cfg.anchor != "kl":
    return None
  return trainer.load_initial_params(ml_collections.ConfigDict(config.to_dict()),
                                     config.init_from)


def train(config: ml_collections.ConfigDict, workdir: str, stop_at: int | None = None,
          init_from: str | None = None, overridden=None) -> dict:
  """Run (or resume) SD·RL in `workdir`, starting a new run from `init_from`'s parameters.

  Mirrors `trainer.train`: `stop_at` ends this invocation at that step (rounded up to the end of
  its rollout) with a checkpoint, as a preemption would; `max_train_minutes` stops likewise.
  Returns the last logged metrics.
  """
  config_checks.validate_run_config(config)
  trainer.check_init_from(init_from, workdir)
  if checkpointing.latest_step(workdir) is None and not init_from:
    raise checkpointing.CheckpointError(
        "SD·RL starts from a trained model: pass --init_from=SFT_WORKDIR (or a checkpoint dir)")
  with workdir_lock.hold(workdir, enabled=jax.process_index() == 0):
    return _train(config, workdir, stop_at, init_from, overridden)


def _train(config, workdir, stop_at, init_from, overridden) -> dict:
  config = ml_collections.ConfigDict(config.to_dict())  # adopting an architecture edits it
  start_step = checkpointing.latest_step(workdir)
  if start_step is not None:
    # The SFT trainer's state layout, so eval.py and sample.py read SD·RL runs unchanged.
    merged, changes = trainer.resume_with(workdir, config, overridden)
    config, _, state, _, start_step = trainer.restore_run(workdir, merged, move_damaged=True)
    print(f"resumed from step {start_step} in {workdir}" +
          (" (--init_from applies only to a new run)" if init_from else ""))
    trainer.record_resume_changes(workdir, merged, changes, start_step)
  else:
    start_step = 0
    print(f"initialising from {init_from}")
    params = trainer.load_initial_params(config, init_from)
    with config.unlocked():
      config.init_from = os.path.abspath(init_from)
    validate_config(config)
    state = trainer.init_state(config, trainer.make_setup(config), params)
    checkpointing.save_config(workdir, config)
  # After the restore: damaged steps it moved aside must not be in the manager's step list.
  mngr = checkpointing.manager(workdir, keep=config.keep_checkpoints)
  # Committed like the update's outputs (a fresh state's scalars are not), so each jitted
  # function compiles once.
  state = jax.jit(lambda state: state, donate_argnums=0)(state)
  model_cfg = trainer.model_config(config)
  optimizer = OptimizerSpec.of(config)
  cfg = sdrl_config(config)
  loss_cfg = trainer.loss_config(config)
  rollout_cfg = rollout_sampler_config(config)
  eval_sampler_cfg = trainer.sampler_config(config)
  reference_params = _load_reference(config, cfg)
  n_updates = cfg.updates_per_rollout
  print(f"model: {model.count_params(state['params']) / 1e6:.3f}M parameters; SD·RL updates "
        f"{start_step}..{config.num_train_steps} ({cfg.mode}, {cfg.rows} rollouts of "
        f"{cfg.prompts_per_rollout} prompts x G={cfg.group_size}, {n_updates} update(s) each)")

  generate_fn = sampler.make_generate_fn(model_cfg, rollout_cfg)
  anchor_batches = (data.train_batches(config.data, cfg.anchor_batch_size,
                                       config.num_train_steps, start_step,
                                       model_cfg.canvas_length)
                    if cfg.anchor == "sft" else None)
  writer = ScalarWriter(os.path.join(workdir, "tensorboard"))
  eval_set = (trainer.held_out_puzzles(config.eval) if config.eval.every_steps > 0
              else (None, None))
  eval_generate_fn = sampler.make_generate_fn(model_cfg, eval_sampler_cfg)
  stops = sampler.stop_ids(model_cfg, rollout_cfg)

  end_time = trainer.deadline(config)
  last = {}
  bar = tqdm(total=config.num_train_steps, initial=start_step, desc="sdrl", unit="update",
             dynamic_ncols=True)
  step = start_step
  try:
    while step < config.num_train_steps:
      t_start = time.perf_counter()
      prompt_BxP, valid_BxP, task = rollout_prompts(cfg, step // n_updates,
                                                    config.data.prompt_format)
      rollout = generate_fn(state["params"], prompt_BxP, valid_BxP,
                            stream_key(state["rng"], _ROLLOUT_STREAM, step))
      tokens_BxL = np.asarray(rollout["tokens"])
      t_rollout = time.perf_counter()
      stats = jax.device_get({key: rollout[key] for key in ROLLOUT_STATS})
      rewarded = rewards.compute(cfg.reward, tokens_BxL, task, stats["steps_per_canvas"],
                                 stats["num_tokens"], rollout_cfg.max_denoising_steps,
                                 rollout_cfg.max_new_tokens, stops, model_cfg.pad_token_id)
      weight_B = advantages(rewarded["reward"], cfg)
      cell_weight_BxL = None
      if cfg.cell_weighting == "consistent":
        cell_weight_BxL = rewards.consistent_token_mask(tokens_BxL, task).astype(np.float32)
      batch = prepare_states(state["params"], model_cfg, rollout_cfg, cfg, prompt_BxP, valid_BxP,
                             rollout, weight_B, stream_key(state["rng"], _STATES_STREAM, step),
                             cell_weight_BxL)
      jax.block_until_ready(batch)
      t_states = time.perf_counter()
      for _ in range(n_updates):
        anchor_batch = (run_guard.next_batch(anchor_batches, step + 1, workdir)
                        if anchor_batches is not None else None)
        state, metrics = update_step(state, model_cfg, cfg, loss_cfg, optimizer, batch,
                                     reference_params, anchor_batch)
        step += 1
      metrics = jax.tree_util.tree_map(float, jax.device_get(metrics))
      t_end = time.perf_counter()
      bar.update(n_updates)

      total = t_end - t_start
      metrics.update(_rollout_metrics(stats, rewarded, np.asarray(weight_B), cfg))
      metrics.update({
          "states/replay_agreement": float(batch["replay_agreement"]),
          "states/position": float(batch["state_position"]),
          "time/seconds_per_rollout": total,
          "time/rollout_share": (t_rollout - t_start) / total,
          "time/states_share": (t_states - t_rollout) / total,  # rewards + replay
          "time/update_share": (t_end - t_states) / total})
      if step % config.log_every < n_updates or step >= config.num_train_steps:
        writer.write(step, metrics)
      bar.set_postfix(
          r=f"{metrics['rollout/reward_mean']:.2f}±{metrics['rollout/reward_std']:.2f}",
          acc=f"{metrics['rollout/accuracy']:.2f}",
          TPF=f"{metrics['rollout/tokens_per_forward']:.1f}",
          steps=f"{metrics['rollout/steps_per_canvas']:.1f}",
          time=f"rollout {metrics['time/rollout_share']:.0%} "
               f"update {metrics['time/update_share']:.0%}")
      last.update(metrics)

      timed_out = end_time is not None and time.time() > end_time
      final = step >= config.num_train_steps
      stopping = timed_out or (stop_at is not None and step >= stop_at)
      if config.eval.every_steps > 0 and (step % config.eval.every_steps < n_updates or final
                                          or stopping):
        last.update(trainer.evaluate_and_log(step, state["params"], model_cfg, eval_sampler_cfg,
                                             config, eval_set, eval_generate_fn, writer))
      if step % config.checkpoint_every == 0 or final or stopping:
        checkpointing.save(mngr, step, state)
      if timed_out:
        tqdm.write(f"stopping at step {step}: max_train_minutes={config.max_train_minutes} reached")
      if stopping:
        break
  except BaseException:  # the loop's own error is the one the user sees
    trainer.close_run(bar, mngr, writer, failed=True)
    raise
  trainer.close_run(bar, mngr, writer)
  return last
