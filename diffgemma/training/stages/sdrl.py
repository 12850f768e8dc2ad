"""SD·RL: online sampler distillation + reinforcement learning after SFT, as a training stage.

One rollout (every `updates_per_rollout` steps of the shared training loop):
  1. G samples per prompt (`RlTask.rollout_prompts`) from the current parameters with the
     production sampler (`sampler.generate`, jitted, `record_trajectory=True`): every step's
     input canvas and argmax, and which rows ran it;
  2. rewards from the task's verifier (`RlTask.reward`), shaped (`rewards.shape`), group-relative
     advantages A = (r - mean_G) / (std_G + eps) and from them each trajectory's weight;
  3. states: a few steps of each canvas's trajectory (`select_steps`); the self-conditioning
     input the sampler had at each is rebuilt by replaying its decoder steps on the recorded
     canvases (`replay`; the recorder keeps canvases, not the [C, V] self-conditioning logits);
then `updates_per_rollout` steps of the shared update step (`update_step.make_update_step`: mesh,
LoRA, gradient accumulation, non-finite guard) on the weighted loss: from each state, the
decoder's CE toward the trajectory's final canvas, times the trajectory's weight
(`sdrl_loss`), plus an optional anchor.
Modes (`sdrl.mode`): "both" (the design), "distill" (every advantage 1: plain self-distillation
toward the model's own final canvases), "rl" (advantage-weighted denoising CE on forward-process
corruptions of the final canvas instead of trajectory states).

The checkpointed state is the SFT state, so eval.py and sample.py read an SD·RL workdir as any
run. Rollouts happen at multiples of `updates_per_rollout`, and checkpoints only there, so a
resumed run redraws exactly the rollouts of an uninterrupted one.

Shape suffixes: B rollout rows (prompts x G), G group size, P prompt, K canvases, N max
denoising steps, M states per canvas trajectory, S = K * M states per row (s = k * M + m), C
canvas, V vocab, D hidden. A state batch is row-major ([B, S, ...]) so that gradient
accumulation and batch sharding split it by rollout rows.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diffgemma import errors
from diffgemma.model import sharding, transformer
from diffgemma.model.config import ModelConfig
from diffgemma.runs import distributed, guard
from diffgemma.sampling import sampler
from diffgemma.tasks.base import Prompts, RlTask
from diffgemma.training import diffusion, evaluation, losses, rewards, training_state

MODES = ("both", "distill", "rl")
STATE_SELECTIONS = ("uniform", "first_k", "last_k", "all")
ADVANTAGE_NORMS = ("group_std", "group_mean", "none")
ANCHORS = ("none", "kl", "sft")
CELL_WEIGHTINGS = ("none", "consistent")
TARGETS = ("final", "verified")
# Independent random streams of one step, folded into the run's key.
_ROLLOUT_STREAM, _STATES_STREAM, _UPDATE_STREAM = range(3)


@dataclasses.dataclass(frozen=True)
class SdrlConfig:
  """Every generic SD·RL choice (config section `sdrl`; see configs/sdrl_sudoku.py).

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
  cell_weighting: "none" (every target token counts) or "consistent" (only the tokens the
    task's verifier finds consistent, `RlTask.token_weights`: e.g. Sudoku's consistent cells).
  target: what each state is trained toward. "final": its trajectory's final canvas (right or
    wrong; the weights decide). "verified": the final canvas of a trajectory the verifier calls
    correct, else the task's reference reply (`RlTask.reference_reply`), so every state learns
    to reach a right canvas from where the sampler actually was; a wrong row's canvas counts
    only while the canvases committed before it equal the reference's (the reference is the
    right continuation of a right context only).
  certainty_weight: beta of the certainty term (certainty-forcing, as in dParallel): the mean
    entropy of the decoder's prediction at each state's positions whose argmax already equals
    the target, weighted as the CE (negative weights count as 0). The sampler accepts positions
    and stops a canvas by their entropy (`sampler.entropy_bounded_accept`, the stop test's
    `confidence_threshold`), so states made certain where they are right are steps saved; the
    CE alone stops pushing once p(target) is near 1 (its logit gradient is 1 - p). 0 = off.
  anchor: "none"; "kl" KL(reference || model) of the decoder on the trained states, the
    reference being the initial parameters; "sft" the SFT loss on the task's training data
    (`anchor_batch_size` examples per update). Weighted by anchor_weight.
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
  target: str = "final"
  certainty_weight: float = 0.0
  anchor: str = "none"
  anchor_weight: float = 0.0
  anchor_batch_size: int = 16

  def __post_init__(self):
    for name, value, choices in (("mode", self.mode, MODES),
                                 ("state_selection", self.state_selection, STATE_SELECTIONS),
                                 ("advantage_norm", self.advantage_norm, ADVANTAGE_NORMS),
                                 ("cell_weighting", self.cell_weighting, CELL_WEIGHTINGS),
                                 ("target", self.target, TARGETS),
                                 ("anchor", self.anchor, ANCHORS)):
      if value not in choices:
        raise ValueError(f"unknown sdrl.{name} {value!r}; choose one of {choices}")
    for name in ("group_size", "prompts_per_rollout", "updates_per_rollout",
                 "states_per_trajectory", "anchor_batch_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"sdrl.{name} must be positive, got {getattr(self, name)}")
    if self.group_size < 2 and self.mode != "distill" and self.advantage_norm != "none":
      raise ValueError("group-relative advantages need sdrl.group_size >= 2")
    if self.advantage_eps <= 0:
      raise ValueError("sdrl.advantage_eps must be positive")
    for name in ("negative_advantage_weight", "advantage_clip", "reward_weight", "anchor_weight",
                 "certainty_weight"):
      if getattr(self, name) < 0:
        raise ValueError(f"sdrl.{name} must be >= 0, got {getattr(self, name)}")

  @property
  def rows(self) -> int:
    return self.group_size * self.prompts_per_rollout


_SECTIONS = ("shaping", "rollout_sampler")


@dataclasses.dataclass(frozen=True)
class SdrlSettings:
  """The SD·RL stage's typed section: its generic knobs, the rollout sampler (without the
  task's stop ids) and the reward shaping (`sdrl.shaping`). What to roll out and how to score
  it is the task's own section `rl` (`RlTask`), read when the task is built."""

  cfg: SdrlConfig
  rollout_sampler: sampler.SamplerConfig
  shaping: rewards.ShapingConfig


def settings(config: ml_collections.ConfigDict) -> SdrlSettings:
  """The `sdrl` section typed and checked against the run's schedule (ValueError, one line)."""
  section = {k: v for k, v in config.sdrl.to_dict().items() if k not in _SECTIONS}
  unknown = sorted(set(section) - {f.name for f in dataclasses.fields(SdrlConfig)})
  if unknown:
    raise ValueError(f"unknown key sdrl.{unknown[0]} (the RL task's rollout prompts and reward "
                     "are section rl: rl.prompts, rl.reward, rl.reward_fn)")
  cfg = SdrlConfig(**section)
  rollout = sampler.SamplerConfig(**config.sdrl.rollout_sampler.to_dict()).replace(
      record_trajectory=True, mode=sampler.DIFFUSION)
  shaping = rewards.ShapingConfig(
      **(config.sdrl.shaping.to_dict() if "shaping" in config.sdrl else {}))
  # Checkpoints (and the end) fall between rollouts, so a resumed run redraws the same ones.
  for name in ("checkpoint_every", "num_train_steps"):
    if config[name] % cfg.updates_per_rollout:
      raise ValueError(f"{name}={config[name]} must be a multiple of "
                       f"sdrl.updates_per_rollout={cfg.updates_per_rollout}")
  accum = config.get("grad_accum_steps", 1)
  for name, rows in (("rollout rows (group_size x prompts_per_rollout)", cfg.rows),
                     ("sdrl.anchor_batch_size", cfg.anchor_batch_size)):
    if rows % accum:
      raise ValueError(f"grad_accum_steps={accum} does not divide the {name} = {rows}")
  return SdrlSettings(cfg, rollout, shaping)


def num_states(cfg: SdrlConfig, sampler_cfg: sampler.SamplerConfig) -> int:
  """M: states per canvas trajectory."""
  if cfg.state_selection == "all" and cfg.mode != "rl":
    return sampler_cfg.max_denoising_steps
  return cfg.states_per_trajectory


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
    emb_BxCxD = transformer.self_conditioning_embedding(params, state.self_cond_BxCxV, model_cfg)
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
  cache = transformer.init_cache(model_cfg, b, p + context_BxT.shape[1] + model_cfg.canvas_length)
  tokens = jnp.concatenate([prompt_BxP, context_BxT], axis=1).astype(jnp.int32)
  valid = jnp.concatenate([prompt_valid_BxP, jnp.ones(context_BxT.shape, bool)], axis=1)
  return transformer.encode(params, model_cfg, tokens, cache, valid)[1]


def _row_major(x_KxMxB):
  """[K, M, B, ...] -> [B, S = K * M, ...]."""
  k, m, b = x_KxMxB.shape[:3]
  x = jnp.moveaxis(x_KxMxB, 2, 0)
  return x.reshape((b, k * m) + x_KxMxB.shape[3:])


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def prepare_states(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                   cfg: SdrlConfig, accum: int, prompt_BxP, prompt_valid_BxP,
                   rollout: sampler.GenerateOutput, weight_B, rng, token_weight_BxL=None,
                   reference_BxL=None, use_reference_B=None):
  """The training batch of one rollout, row-major, and its replay statistics (jitted; configs
  and the number of micro-batches `accum` static).

  rollout: `generate`'s output with a trajectory. Returns (batch, stats). batch: prompt_BxP,
  prompt_valid_BxP, context_BxT (the committed canvases), weight_B, norm_B (the number of valid
  states of the whole batch over `accum`, on every row: a micro-batch's loss divided by it sums
  to the whole batch's mean), and per state s = k * M + m of row b: prefix_len_BxS, target_BxSxC
  (canvas k's final argmax), valid_BxS (the state exists), step_BxS (its step, -1 for "rl");
  trajectory modes also canvas_BxSxC and self_cond_BxSxCxD (its decoder input); with
  `token_weight_BxL` (a weight per generated token), token_weight_BxSxC. `reference_BxL`
  (int32, the reference replies over the K*C slots) with `use_reference_B` (bool): those rows'
  targets are the reference's canvases, and their canvas k has states only where the committed
  canvases before it equal the reference's (`SdrlConfig.target`). stats: scalars
  replay_agreement (share of replayed steps whose argmax canvas equals the recorded one) and
  state_position (mean step / steps of the canvas, of valid states).
  """
  traj = rollout.trajectory
  k_max, _, b, c = traj["canvas"].shape
  p = prompt_BxP.shape[1]
  num = num_states(cfg, sampler_cfg)
  num_steps_KxB = jnp.sum(traj["valid"], axis=1).astype(jnp.int32)
  last_KxBx1 = jnp.maximum(num_steps_KxB - 1, 0)[:, :, None]
  final_KxBxC = jnp.take_along_axis(traj["argmax"], last_KxBx1[:, None], axis=1)[:, 0]
  has_states_KxB = num_steps_KxB > 0
  if reference_BxL is not None:
    reference_KxBxC = jnp.asarray(reference_BxL, jnp.int32).reshape(b, k_max, c).transpose(1, 0, 2)
    committed_KxBxC = rollout.tokens.reshape(b, k_max, c).transpose(1, 0, 2)
    same_KxB = jnp.all(committed_KxBxC == reference_KxBxC, axis=-1)
    # Canvas k's context is right when every canvas before it is: an exclusive running AND.
    right_context_KxB = jnp.cumprod(jnp.concatenate(
        [jnp.ones((1, b), jnp.int32), same_KxB[:-1].astype(jnp.int32)]), axis=0) > 0
    use_1xB = jnp.asarray(use_reference_B, bool)[None]
    final_KxBxC = jnp.where(use_1xB[:, :, None], reference_KxBxC, final_KxBxC)
    has_states_KxB &= ~use_1xB | right_context_KxB
  per_state = lambda x_KxBx: jnp.broadcast_to(x_KxBx[:, None], (k_max, num) + x_KxBx.shape[1:])
  prefix_KxB = jnp.broadcast_to((p + c * jnp.arange(k_max, dtype=jnp.int32))[:, None], (k_max, b))
  batch = {"prompt_BxP": prompt_BxP, "prompt_valid_BxP": prompt_valid_BxP,
           "context_BxT": context_tokens(rollout.tokens, model_cfg),
           "weight_B": jnp.asarray(weight_B, jnp.float32),
           "prefix_len_BxS": _row_major(per_state(prefix_KxB)),
           "target_BxSxC": _row_major(per_state(final_KxBxC))}
  if token_weight_BxL is not None:
    weight_KxBxC = jnp.asarray(token_weight_BxL, jnp.float32).reshape(b, k_max, c).transpose(1, 0, 2)
    batch["token_weight_BxSxC"] = _row_major(per_state(weight_KxBxC))
  if cfg.mode == "rl":
    valid_KxMxB = per_state(has_states_KxB)
    stats = {"replay_agreement": jnp.ones(()), "state_position": jnp.zeros(())}
    step_KxMxB = jnp.full(valid_KxMxB.shape, -1, jnp.int32)
  else:
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
    valid_KxMxB = (pick_KxMxB >= 0) & has_states_KxB[:, None]
    step_KxMxB = pick_KxMxB
    position_KxMxB = pick_KxMxB / jnp.maximum(num_steps_KxB[:, None], 1)
    batch.update(canvas_BxSxC=_row_major(jnp.stack(canvases)),
                 self_cond_BxSxCxD=_row_major(jnp.stack(self_conds)))
    stats = {"replay_agreement": agree / jnp.maximum(ran, 1),
             "state_position": losses.masked_mean(position_KxMxB, valid_KxMxB)}
  batch["valid_BxS"] = _row_major(valid_KxMxB)
  batch["step_BxS"] = _row_major(step_KxMxB)
  num_valid = jnp.maximum(jnp.sum(valid_KxMxB), 1).astype(jnp.float32)
  batch["norm_B"] = jnp.full((b,), num_valid / accum, jnp.float32)
  return batch, stats


# ----------------------------------------------------------------------------- loss


def _decoder_logits(params, model_cfg: ModelConfig, cfg: SdrlConfig, loss_cfg, batch, rng,
                    inputs=None):
  """Decoder logits [B * S, C, V] on the state rows, and the inputs that produced them.

  Trajectory modes: the recorded canvas and self-conditioning embedding. "rl": the final canvas
  corrupted at t ~ U(t_eps, 1), self-conditioned as in SFT. `inputs` (from a previous call)
  replays the same inputs, e.g. for the anchor's reference model.
  """
  b, s = batch["valid_BxS"].shape
  flat = lambda x: x.reshape((b * s,) + x.shape[2:])
  cache = encode_context(params, model_cfg, batch["prompt_BxP"], batch["prompt_valid_BxP"],
                         batch["context_BxT"])
  cache_U = losses.take_cache_rows(cache, jnp.repeat(jnp.arange(b), s))
  prefix_U = flat(batch["prefix_len_BxS"])
  if cfg.mode != "rl":
    return transformer.decode(params, model_cfg, flat(batch["canvas_BxSxC"]), cache_U, prefix_U,
                              None, None, flat(batch["self_cond_BxSxCxD"])), None
  if inputs is not None:
    noisy_UxC, sc_logits, sc_mask_U = inputs
    return transformer.decode(params, model_cfg, noisy_UxC, cache_U, prefix_U, sc_logits,
                              sc_mask_U), inputs
  t_rng, noise_rng = jax.random.split(rng)
  target_UxC = flat(batch["target_BxSxC"])
  t_U = diffusion.sample_noise_level(t_rng, target_UxC.shape[0], loss_cfg.t_eps,
                                     loss_cfg.t_distribution)
  noisy_UxC = diffusion.corrupt(noise_rng, target_UxC, t_U, model_cfg.vocab_size,
                                loss_cfg.noise_schedule)
  logits, sc_logits, sc_mask_U = losses.self_conditioned_logits(
      params, model_cfg, noisy_UxC, cache_U, prefix_U, loss_cfg.self_conditioning_prob)
  return logits, (noisy_UxC, sc_logits, sc_mask_U)


def sdrl_loss(params, model_cfg: ModelConfig, cfg: SdrlConfig, loss_cfg: losses.LossConfig,
              batch: dict, rng, reference_params=None, anchor_batch=None, anchor_layout=None):
  """(loss, metrics): weighted decoder CE toward the final canvases, the certainty term and the
  anchor.

  loss = sum_{b,s} (w_b * CE_{b,s} + beta * max(w_b, 0) * H_{b,s}) / norm
         + anchor_weight * anchor, with w the rows' weights
  (`advantages`), CE_{b,s} the mean over the canvas of the decoder's CE toward state (b, s)'s
  final canvas (each token times its token_weight when the batch has them), summed over valid
  states, H_{b,s} the mean over the canvas of the prediction's entropy at positions whose argmax
  equals the target (0 elsewhere), beta = certainty_weight, and norm = batch["norm_B"] (the
  whole batch's valid-state count per micro-batch).
  """
  decode_rng, anchor_rng = jax.random.split(rng)
  logits_UxCxV, inputs = _decoder_logits(params, model_cfg, cfg, loss_cfg, batch, decode_rng)
  b, s = batch["valid_BxS"].shape
  target_UxC = batch["target_BxSxC"].reshape(b * s, -1)
  valid_U = batch["valid_BxS"].reshape(-1)
  ce_UxC = losses.cross_entropy(logits_UxCxV, target_UxC)
  if "token_weight_BxSxC" in batch:  # masked tokens count as zero, not renormalised away
    ce_UxC = ce_UxC * batch["token_weight_BxSxC"].reshape(b * s, -1)
  ce_U = jnp.mean(ce_UxC, axis=-1)
  weight_U = jnp.repeat(batch["weight_B"], s) * valid_U
  norm = batch["norm_B"][0]
  policy_loss = jnp.sum(weight_U * ce_U) / norm
  correct_UxC = jnp.argmax(logits_UxCxV, axis=-1) == target_UxC
  metrics = {"policy_loss": policy_loss, "state_ce": losses.masked_mean(ce_U, valid_U),
             "state_token_accuracy": losses.masked_mean(jnp.mean(correct_UxC, -1), valid_U)}
  certainty = jnp.zeros(())
  if cfg.certainty_weight:
    # Entropy only where the prediction is already right: certainty there cannot commit an error.
    entropy_UxC = sampler.token_entropy(logits_UxCxV) * correct_UxC
    if "token_weight_BxSxC" in batch:
      entropy_UxC = entropy_UxC * batch["token_weight_BxSxC"].reshape(b * s, -1)
    certainty = jnp.sum(jnp.maximum(weight_U, 0) * jnp.mean(entropy_UxC, axis=-1)) / norm
    metrics["certainty_loss"] = certainty
  anchor = jnp.zeros(())
  if cfg.anchor == "kl":
    ref_logits_UxCxV, _ = _decoder_logits(reference_params, model_cfg, cfg, loss_cfg, batch,
                                          decode_rng, inputs)
    ref_logp = jax.nn.log_softmax(jax.lax.stop_gradient(ref_logits_UxCxV), axis=-1)
    logp = jax.nn.log_softmax(logits_UxCxV, axis=-1)
    kl_U = jnp.mean(jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1), axis=-1)
    anchor = jnp.sum(kl_U * valid_U) / norm
  elif cfg.anchor == "sft":
    anchor, _ = losses.sft_loss(params, model_cfg, loss_cfg, anchor_layout, anchor_batch,
                                anchor_rng)
  if cfg.anchor != "none":
    metrics["anchor"] = anchor
  total = policy_loss + cfg.certainty_weight * certainty + cfg.anchor_weight * anchor
  metrics["loss"] = total
  return total, metrics


def stream_key(state_rng, stream: int, step):
  """The key of one of a step's independent random streams (rollout, states, update)."""
  return jax.random.fold_in(jax.random.fold_in(state_rng, stream), step)


# ----------------------------------------------------------------------------- the stage


def _rollout_metrics(stats: dict, rewarded: dict, weight_B, cfg: SdrlConfig) -> dict:
  """A rollout's scalars. groups_with_spread: the share of prompts whose G rewards are not all
  equal (a group without one has zero advantage everywhere); correct_groups_with_spread: the
  same for the 0/1 `correct` flags, i.e. what an exact-match reward would have given.
  wrong_weight_share: the share of the rows' total |weight| on rows the verifier calls wrong
  (with target="final" their states are trained toward a wrong canvas, pushed up or down);
  negative_weight_share: the share on negative weights."""
  reward_PxG = rewarded["reward"].reshape(-1, cfg.group_size)
  correct_PxG = np.asarray(rewarded["correct"]).reshape(-1, cfg.group_size)
  magnitude_B = np.abs(np.asarray(weight_B, np.float64))
  total = max(float(magnitude_B.sum()), 1e-12)
  return {
      "rollout/reward_mean": float(np.mean(rewarded["reward"])),
      "rollout/reward_std": float(np.std(rewarded["reward"])),
      "rollout/group_reward_std": float(np.mean(np.std(reward_PxG, axis=1))),
      "rollout/groups_with_spread": float(np.mean(np.ptp(reward_PxG, axis=1) > 0)),
      "rollout/correct_groups_with_spread": float(np.mean(correct_PxG.any(1) & ~correct_PxG.all(1))),
      "rollout/score_mean": float(np.mean(rewarded["score"])),
      "rollout/accuracy": float(np.mean(rewarded["correct"])),
      "rollout/tokens_per_forward": float(np.mean(stats["tokens_per_forward"])),
      "rollout/steps_per_canvas": float(np.mean(stats["steps_per_canvas"])),
      "rollout/weight_mean": float(np.mean(weight_B)),
      "rollout/wrong_weight_share": float(magnitude_B[~correct_PxG.reshape(-1)].sum() / total),
      "rollout/negative_weight_share": float(magnitude_B[np.asarray(weight_B) < 0].sum() / total),
  }


class SdrlStage:
  """SD·RL as a stage of the shared loop: rollouts every `updates_per_rollout` steps, the
  weighted distillation / RL loss on their states, the anchor's batches."""

  name = "sdrl"
  update_stream = _UPDATE_STREAM  # the update's randomness: stream_key(rng, this, step)
  requires_init_from = True
  settings = staticmethod(settings)

  def __init__(self, settings: SdrlSettings, task: RlTask, setup: training_state.Setup):
    if not isinstance(task, RlTask):
      raise ValueError(f"the {task.name} task has no rollout prompts or rewards (it is no "
                       "RlTask): SD·RL cannot train on it; use stage='sft'")
    if task.image_slots is not None:
      raise errors.ConfigError("SD·RL does not support image tasks (data.max_images > 0): its "
                               "rollouts and state replays take no images; train them with "
                               "stage='sft'")
    self.task, self.setup = task, setup
    self.cfg = settings.cfg
    self.rollout_cfg = settings.rollout_sampler.with_stops(task.stop_token_ids)
    self.shaping = settings.shaping
    self.num_steps = setup.train_cfg.num_train_steps
    if self.cfg.cell_weighting != "none" and task.token_weights(
        task.rollout_prompts(0, 1), np.zeros((1, task.layout.response_len), np.int32)) is None:
      raise ValueError(f"sdrl.cell_weighting={self.cfg.cell_weighting!r}: the "
                       f"{task.name} task gives no token weights")
    if self.cfg.target == "verified":
      reference = task.reference_reply(task.rollout_prompts(0, 1))
      slots = (sampler.num_canvases(setup.model_cfg, self.rollout_cfg)
               * setup.model_cfg.canvas_length)
      if reference is None:
        raise ValueError(f"sdrl.target='verified': the {task.name} task gives no reference "
                         "replies; use sdrl.target='final'")
      if reference.shape[1] != slots:
        raise ValueError(f"sdrl.target='verified': the reference replies fill "
                         f"{reference.shape[1]} slots but the rollout sampler writes {slots} "
                         "(sdrl.rollout_sampler.max_new_tokens); keep the task's reply budget")
    self.generate_fn = sampler.make_generate_fn(setup.model_cfg, self.rollout_cfg)
    self._reference = None
    if self.cfg.anchor == "kl" and not setup.uses_lora:
      # The initial parameters; a LoRA run's reference is its frozen base (adapters start at 0).
      self._reference = training_state.load_initial_params(
          setup.model_cfg, setup.run.init_from, setup.train_cfg.seed, setup.mesh, setup.rules)
    self._anchor_batches = self._rollout = None

  def start(self, state, frozen, start_step: int, workdir: str):
    del state
    self._workdir = workdir
    if self.setup.uses_lora and self.cfg.anchor == "kl":
      self._reference = frozen
    if self.cfg.anchor == "sft":
      self._anchor_batches = self.task.train_batches(
          self.cfg.anchor_batch_size, self.num_steps, start_step, jax.process_index(),
          jax.process_count())

  def loss_fn(self, params, batch, rng):
    return sdrl_loss(params, self.setup.model_cfg, self.cfg, self.setup.loss_cfg,
                     batch["states"], rng, self._reference, batch.get("anchor"),
                     self.task.packing or self.task.layout)

  def is_boundary(self, step: int) -> bool:
    return step % self.cfg.updates_per_rollout == 0

  def tokens_per_batch(self):
    return None

  def batch_counts(self, step, batch):
    """A rollout's rows (its sampled replies), counted at the update that samples it: their
    valid prompt tokens and the reply slots they were sampled into (the SFT anchor's batches
    are not counted)."""
    states = batch["states"]
    if step % self.cfg.updates_per_rollout:
      return jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    rows = states["prompt_valid_BxP"].shape[0]
    return (jnp.asarray(rows, jnp.int32),
            jnp.sum(states["prompt_valid_BxP"], dtype=jnp.int32)
            + rows * self.rollout_cfg.max_new_tokens)

  @staticmethod
  def progress_fields(metrics):
    return {"r": f"{metrics['rollout/reward_mean']:.2f}±{metrics['rollout/reward_std']:.2f}",
            "acc": f"{metrics['rollout/accuracy']:.2f}",
            "TPF": f"{metrics['rollout/tokens_per_forward']:.1f}",
            "steps": f"{metrics['rollout/steps_per_canvas']:.1f}"}

  def _prompts(self, iteration: int) -> Prompts:
    return self.task.rollout_prompts(iteration, self.cfg.prompts_per_rollout).repeat(
        self.cfg.group_size)

  def rollout(self, step, state, frozen):
    """One rollout from the current parameters: (state batch, host metrics)."""
    t_start = time.perf_counter()
    params = training_state.model_params(state["params"], frozen, self.setup.lora_cfg)
    prompts = self._prompts(step // self.cfg.updates_per_rollout)
    out = self.generate_fn(params, prompts.prompt_NxP, prompts.valid_NxP,
                           stream_key(state["rng"], _ROLLOUT_STREAM, step))
    # The whole rollout's tokens and per-row stats (the evaluation's list) on every process
    # (rows may live on other hosts).
    host = distributed.fetch({"tokens": out.tokens, **evaluation.row_stats(out)})
    tokens_BxL = np.asarray(host.pop("tokens"))
    t_rollout = time.perf_counter()
    stats = host
    score, correct = self.task.reward(prompts, tokens_BxL)
    rewarded = rewards.shape(self.shaping, score, correct, stats["steps_per_canvas"],
                             stats["num_tokens"], self.rollout_cfg.max_denoising_steps,
                             self.rollout_cfg.max_new_tokens)
    weight_B = advantages(rewarded["reward"], self.cfg)
    token_weight_BxL = (self.task.token_weights(prompts, tokens_BxL)
                        if self.cfg.cell_weighting != "none" else None)
    reference_BxL = use_reference_B = None
    if self.cfg.target == "verified":
      reference_BxL, use_reference_B = self.task.reference_reply(prompts), ~rewarded["correct"]
    batch, replay_stats = prepare_states(
        params, self.setup.model_cfg, self.rollout_cfg, self.cfg, self.setup.grad_accum_steps,
        prompts.prompt_NxP, prompts.valid_NxP, out, weight_B,
        stream_key(state["rng"], _STATES_STREAM, step), token_weight_BxL, reference_BxL,
        use_reference_B)
    replay_stats = distributed.fetch(replay_stats)
    t_states = time.perf_counter()
    metrics = _rollout_metrics(stats, rewarded, np.asarray(weight_B), self.cfg)
    metrics.update({
        "states/replay_agreement": float(replay_stats["replay_agreement"]),
        "states/position": float(replay_stats["state_position"]),
        # The rollout's host-side time: sampling, then rewards and the state replay.
        "time/rollout_seconds": t_states - t_start,
        "time/sampling_share": (t_rollout - t_start) / (t_states - t_start)})
    return batch, metrics

  def next_batch(self, step, state, frozen):
    metrics = {}
    if self._rollout is None or step % self.cfg.updates_per_rollout == 0:
      self._rollout, metrics = self.rollout(step, state, frozen)
    batch = {"states": self._rollout}
    if self._anchor_batches is not None:
      anchor = guard.next_batch(self._anchor_batches, step + 1, self._workdir)
      batch["anchor"] = {k: np.asarray(v) for k, v in anchor.items()}
    return batch, metrics

  def planned_programs(self, state, frozen):
    """{"rollout": (jitted program, abstract arguments)} of one rollout's sampling."""
    model_cfg, lora_cfg = self.setup.model_cfg, self.setup.lora_cfg

    def run(trainable, frozen, prompt_BxP, valid_BxP, rng):
      params = training_state.model_params(trainable, frozen, lora_cfg)
      return sampler.generate(params, model_cfg, self.rollout_cfg, prompt_BxP, valid_BxP, rng)

    shape = (self.cfg.rows, self.task.layout.prompt_len)
    rows = sharding.batch_sharding(self.setup.mesh, self.setup.rules, shape)
    args = (state["params"], frozen, jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=rows),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(self.setup.mesh)))
    return {"rollout": (jax.jit(run), args)}

  def batch_shapes(self):
    """Shapes of one update's batch, from the rollout and state programs traced abstractly."""
    model_cfg, b = self.setup.model_cfg, self.cfg.rows
    params = transformer.abstract_params(model_cfg)
    p = self.task.layout.prompt_len
    prompt = jax.ShapeDtypeStruct((b, p), jnp.int32)
    valid = jax.ShapeDtypeStruct((b, p), jnp.bool_)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    out = jax.eval_shape(self.generate_fn, params, prompt, valid, key)
    weights = jax.ShapeDtypeStruct((b,), jnp.float32)
    token_weights = (jax.ShapeDtypeStruct(out.tokens.shape, jnp.float32)
                     if self.cfg.cell_weighting != "none" else None)
    states, _ = jax.eval_shape(
        lambda *a: prepare_states(a[0], model_cfg, self.rollout_cfg, self.cfg,
                                  self.setup.grad_accum_steps, *a[1:]),
        params, prompt, valid, out, weights, key, token_weights)
    shapes = {"states": states}
    if self.cfg.anchor == "sft":
      shapes["anchor"] = losses.sft_batch_shapes(self.task.packing or self.task.layout,
                                                 self.cfg.anchor_batch_size)
    return shapes
