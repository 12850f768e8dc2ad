"""SD·RL: advantages, the loss on a hand-computed batch, the trajectory replay, the rewards, and
a short run of the loop from a saved tiny SFT run (with exact resume)."""

import os

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import sdrl_chat, sdrl_sudoku
from diffgemma.io import model_dirs
from diffgemma.model import lora, transformer
from diffgemma.runs import checkpointing, provenance
from diffgemma.sampling import sampler
from diffgemma.tasks import make_task
from diffgemma.tasks import sudoku
from diffgemma.tasks import sudoku_puzzles
from diffgemma.training import (
  diffusion,
  loop,
  losses,
  rewards,
  run_config,
  training_state,
  update_step,
)
from diffgemma.training.stages import sdrl
from tests.helpers import restore_run, save_sft_run, setup_of, tiny_configs






# The loop test's model (one full-attention layer: the SD·RL plumbing, not the architecture)
# for every test: one set of programs.
CFG = run_config.build(tiny_configs()[1]).model




@pytest.fixture(scope="module")
def params():
  # As save_sft_run's (one compiled init). An "rbg" key: threefry's op-by-op compiles make init
  # several times slower on CPU.
  return transformer.init_params(CFG, jax.random.key(0, impl="rbg"))


def log_softmax64(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@jax.jit
def state_logits(params, prompt_UxP, canvas_UxC, self_cond_UxCxD):
  """Each state row decoded after its own prompt's encoding (no shared cache)."""
  u, p = prompt_UxP.shape
  cache = transformer.init_cache(CFG, u, p + CFG.canvas_length)
  _, cache = transformer.encode(params, CFG, prompt_UxP, cache)
  return transformer.decode(params, CFG, canvas_UxC, cache, None, None, None, self_cond_UxCxD)


@jax.jit
def corrupted_state_logits(params, prompt_UxP, target_UxC, rng):
  """"rl" rows by hand: sdrl_loss's draws (split(rng) -> decode key -> split -> t key, noise
  key), then every other row self-conditioned on a first pass (prob 0.5), the rest not."""
  u, p = prompt_UxP.shape
  t_rng, noise_rng = jax.random.split(jax.random.split(rng)[0])
  t_U = diffusion.sample_noise_level(t_rng, u, losses.LossConfig().t_eps)
  noisy_UxC = diffusion.corrupt(noise_rng, target_UxC, t_U, CFG.vocab_size, "linear")
  cache = transformer.init_cache(CFG, u, p + CFG.canvas_length)
  _, cache = transformer.encode(params, CFG, prompt_UxP, cache)
  first = transformer.decode(params, CFG, noisy_UxC, cache)
  return noisy_UxC, transformer.decode(params, CFG, noisy_UxC, cache, None, first,
                                       jnp.arange(u) % 2 == 0)


loss_fn = jax.jit(sdrl.sdrl_loss, static_argnums=(1, 2, 3, 8))


# ----------------------------------------------------------------------------- advantages


REWARDS_2x4 = np.array([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])


@pytest.mark.parametrize("norm, neg_weight, clip, reward_weight", [
    ("group_std", 1.0, 0.0, 0.0), ("group_std", 0.25, 1.5, 1.0), ("group_mean", 0.0, 0.0, 0.5),
    ("none", 1.0, 0.0, 0.0)])
def test_advantages_match_numpy(norm, neg_weight, clip, reward_weight):
  cfg = sdrl.SdrlConfig(group_size=4, prompts_per_rollout=2, advantage_norm=norm,
                        negative_advantage_weight=neg_weight, advantage_clip=clip,
                        reward_weight=reward_weight, advantage_eps=1e-3)
  r = REWARDS_2x4
  if norm == "group_std":  # population std, as the design's std_G
    std = np.sqrt(((r - r.mean(1, keepdims=True)) ** 2).mean(1, keepdims=True))
    expected = (r - r.mean(1, keepdims=True)) / (std + 1e-3)
  elif norm == "group_mean":
    expected = r - r.mean(1, keepdims=True)
  else:
    expected = r.copy()
  if clip:
    expected = np.clip(expected, -clip, clip)
  expected = np.where(expected < 0, neg_weight * expected, expected) + reward_weight * r
  got = np.asarray(sdrl.advantages(r.reshape(-1), cfg))
  np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-6, atol=1e-7)
  if norm == "group_std" and not clip and neg_weight == 1.0 and not reward_weight:
    # By hand: one success in four: mean 1/4, std sqrt(3)/4.
    np.testing.assert_allclose(got[:4], np.array([3, -1, -1, -1]) / (np.sqrt(3) + 4e-3),
                               rtol=1e-6)
    assert np.all(got[4:] == 0)  # a group of equal rewards carries no signal


def test_distill_mode_weights_every_sample_equally():
  cfg = sdrl.SdrlConfig(mode="distill", group_size=4, prompts_per_rollout=2)
  np.testing.assert_array_equal(sdrl.advantages(REWARDS_2x4.reshape(-1), cfg), np.ones(8))


# ----------------------------------------------------------------------------- loss


def state_batch(mode, num_states=2):
  """Two rollout rows (one group), one canvas, `num_states` states each; the last is invalid."""
  rng = np.random.default_rng(0)
  b, p, c, d = 2, 3, CFG.canvas_length, CFG.hidden_size
  s = num_states
  valid = np.ones((b, s), bool)
  valid[-1, -1] = False
  batch = {
      "prompt_BxP": jnp.asarray(rng.integers(3, CFG.vocab_size, (b, p)), jnp.int32),
      "prompt_valid_BxP": jnp.ones((b, p), bool),
      "context_BxT": jnp.zeros((b, 0), jnp.int32),
      "weight_B": jnp.asarray([1.5, -0.5], jnp.float32),
      "prefix_len_BxS": jnp.full((b, s), p, jnp.int32),
      "target_BxSxC": jnp.asarray(rng.integers(0, CFG.vocab_size, (b, s, c)), jnp.int32),
      "valid_BxS": jnp.asarray(valid),
      "norm_B": jnp.full((b,), valid.sum(), jnp.float32)}
  if mode != "rl":
    batch["canvas_BxSxC"] = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, s, c)), jnp.int32)
    batch["self_cond_BxSxCxD"] = jnp.asarray(rng.normal(0, 1, (b, s, c, d)), jnp.float32)
  return batch


def flat(x):
  """[B, S, ...] -> [B * S, ...]: state rows in the loss's order."""
  x = np.asarray(x)
  return x.reshape((-1,) + x.shape[2:])


def state_prompts(batch):
  """Each state row's prompt, [B * S, P]."""
  return jnp.repeat(batch["prompt_BxP"], batch["valid_BxS"].shape[1], axis=0)


def expected_policy_loss(logits_UxCxV, batch):
  """sum_u A[row_u] * mean_c (token weight x CE_u,c) / #valid, in float64 numpy."""
  logp = log_softmax64(logits_UxCxV)
  target = flat(batch["target_BxSxC"])
  ce_UxC = -np.take_along_axis(logp, target[..., None], -1)[..., 0]
  weights = flat(batch["token_weight_BxSxC"]) if "token_weight_BxSxC" in batch else 1.0
  ce_U = (ce_UxC * np.asarray(weights, np.float64)).mean(-1)
  valid = flat(batch["valid_BxS"])
  s = batch["valid_BxS"].shape[1]
  weight = np.repeat(np.asarray(batch["weight_B"], np.float64), s) * valid
  return (weight * ce_U).sum() / valid.sum(), ce_U


def test_trajectory_loss_matches_hand_computation(params):
  """Advantage-weighted CE toward the final canvas, plus the KL anchor to a reference model."""
  batch = state_batch("both")
  loss_cfg = losses.LossConfig()
  cfg = sdrl.SdrlConfig(mode="both", group_size=2, prompts_per_rollout=1,
                        states_per_trajectory=2, anchor="kl", anchor_weight=0.5)
  reference = jax.tree_util.tree_map(lambda x: x * 3.0, params)
  total, metrics = loss_fn(params, CFG, cfg, loss_cfg, batch, jax.random.PRNGKey(0), reference)
  prompt_UxP = state_prompts(batch)
  canvas_UxC, self_cond_UxCxD = flat(batch["canvas_BxSxC"]), flat(batch["self_cond_BxSxCxD"])
  logits = state_logits(params, prompt_UxP, canvas_UxC, self_cond_UxCxD)
  expected, ce_U = expected_policy_loss(logits, batch)
  np.testing.assert_allclose(metrics["policy_loss"], expected, rtol=1e-5)
  np.testing.assert_allclose(metrics["state_ce"], ce_U[:3].mean(), rtol=1e-5)  # valid states
  ref_logits = state_logits(reference, prompt_UxP, canvas_UxC, self_cond_UxCxD)
  ref_logp, logp = log_softmax64(ref_logits)[:3], log_softmax64(logits)[:3]
  kl = (np.exp(ref_logp) * (ref_logp - logp)).sum(-1).mean(-1).mean()
  assert kl > 1e-3
  np.testing.assert_allclose(metrics["anchor"], kl, rtol=1e-4)
  np.testing.assert_allclose(total, expected + 0.5 * kl, rtol=1e-5)
  _, same = loss_fn(params, CFG, cfg, loss_cfg, batch, jax.random.PRNGKey(0), params)
  np.testing.assert_allclose(same["anchor"], 0.0, atol=1e-6)  # no drift from itself


def test_cell_weights_scale_each_target_cell(params):
  """With token_weight_BxSxC, a token's CE counts times its weight (0: not distilled) and the
  mean stays over the whole canvas."""
  batch = state_batch("both")
  weights = np.random.default_rng(1).integers(0, 2, batch["target_BxSxC"].shape)
  weights[0, 0] = 0  # a state with no consistent cell adds nothing
  batch["token_weight_BxSxC"] = jnp.asarray(weights, jnp.float32)
  cfg = sdrl.SdrlConfig(mode="both", group_size=2, prompts_per_rollout=1,
                        states_per_trajectory=2, cell_weighting="consistent")
  _, metrics = loss_fn(params, CFG, cfg, losses.LossConfig(), batch, jax.random.PRNGKey(0))
  logits = state_logits(params, state_prompts(batch), flat(batch["canvas_BxSxC"]),
                        flat(batch["self_cond_BxSxCxD"]))
  expected, ce_U = expected_policy_loss(logits, batch)
  assert ce_U[0] == 0 and ce_U[1] > 0
  np.testing.assert_allclose(metrics["policy_loss"], expected, rtol=1e-5)


def test_rl_loss_matches_hand_computation(params):
  """"rl": corruptions of the final canvas (the loss's own draws), SFT self-conditioning."""
  batch = state_batch("rl")
  loss_cfg = losses.LossConfig(self_conditioning_prob=0.5)
  cfg = sdrl.SdrlConfig(mode="rl", group_size=2, prompts_per_rollout=1, states_per_trajectory=2)
  rng = jax.random.PRNGKey(4)
  total, _ = loss_fn(params, CFG, cfg, loss_cfg, batch, rng)
  target_UxC = jnp.asarray(flat(batch["target_BxSxC"]))
  noisy, logits = corrupted_state_logits(params, state_prompts(batch), target_UxC, rng)
  assert not np.array_equal(noisy, target_UxC)
  expected, _ = expected_policy_loss(logits, batch)
  np.testing.assert_allclose(total, expected, rtol=1e-5)


# ----------------------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
  """One recorded rollout of the loop test's model, sampler and shapes (so the compiled
  programs serve every test): three canvases of 27, so later canvases' states sit after
  committed ones. A dict: setup, params, prompt, valid, out (the GenerateOutput), gen_rng, and
  on_mesh (keys replicated over the params' mesh, as the loop's)."""
  sft, config = tiny_configs()
  workdir = str(tmp_path_factory.mktemp("sdrl_rollout") / "sft")
  save_sft_run(sft, workdir)
  setup = setup_of(config)
  params = training_state.load_initial_params(setup.model_cfg, workdir, setup.train_cfg.seed,
                                              setup.mesh, setup.rules)  # placed as the loop's
  scfg, cfg = setup.run.stage_settings.rollout_sampler, setup.run.stage_settings.cfg
  prompts = make_task(config).rollout_prompts(0, cfg.prompts_per_rollout).repeat(cfg.group_size)
  on_mesh = jax.sharding.NamedSharding(params["embedding"].sharding.mesh,
                                       jax.sharding.PartitionSpec())
  gen_rng = jax.device_put(jax.random.PRNGKey(5), on_mesh)
  out = sampler.make_generate_fn(setup.model_cfg, scfg)(params, prompts.prompt_NxP,
                                                         prompts.valid_NxP, gen_rng)
  return {"setup": setup, "params": params, "prompt": prompts.prompt_NxP,
          "valid": prompts.valid_NxP, "out": out, "gen_rng": gen_rng, "on_mesh": on_mesh}


def test_replay_reproduces_the_recorded_trajectory(rollout):
  """Replaying the sampler's steps on the recorded canvases, with the sampler's keys, gives the
  recorded argmax at every step and the recorded next canvas; the prepared training states
  (canvas + self-conditioning) make the decoder produce the recorded argmax of their step."""
  setup, params, out = rollout["setup"], rollout["params"], rollout["out"]
  model_cfg, scfg = setup.model_cfg, setup.run.stage_settings.rollout_sampler
  cfg = setup.run.stage_settings.cfg
  prompt, valid, gen_rng, on_mesh = (rollout[k] for k in ("prompt", "valid", "gen_rng", "on_mesh"))
  b, p, c = prompt.shape[0], prompt.shape[1], model_cfg.canvas_length
  traj = out.trajectory
  steps = np.asarray(traj["valid"]).sum(1)  # [K, B]
  assert steps.shape == (3, b) and steps[0].min() >= 1 and len(np.unique(steps)) > 1

  replay = jax.jit(sdrl.replay, static_argnums=(1, 2))
  cache = jax.jit(sdrl.encode_context, static_argnums=1)(
      params, model_cfg, prompt, valid, sdrl.context_tokens(out.tokens, model_cfg))
  for k in range(3):
    loop_key = jax.random.split(jax.random.fold_in(gen_rng, k))[1]  # denoise_canvas's
    canvas_cache = dict(cache, end=jnp.asarray(p + k * c))
    got = replay(params, model_cfg, scfg, canvas_cache, traj["canvas"][k], traj["valid"][k],
                 loop_key)
    ran = np.asarray(traj["valid"][k])
    np.testing.assert_array_equal(np.asarray(got["argmax"])[ran],
                                  np.asarray(traj["argmax"][k])[ran])
    fed_next = ran[1:]  # canvas n + 1 is step n's output
    np.testing.assert_array_equal(np.asarray(got["canvas"])[:-1][fed_next],
                                  np.asarray(traj["canvas"][k])[1:][fed_next])

  batch, stats = sdrl.prepare_states(params, model_cfg, scfg, cfg, 1, prompt, valid, out,
                                     sdrl.advantages(np.ones(b), cfg),
                                     jax.device_put(jax.random.PRNGKey(0), on_mesh))
  assert float(stats["replay_agreement"]) == 1.0
  s = batch["valid_BxS"].shape[1]
  ok = flat(batch["valid_BxS"])
  row_U, step_U = np.repeat(np.arange(b), s), flat(batch["step_BxS"])
  prefix_U = flat(batch["prefix_len_BxS"])
  k_U = (prefix_U - p) // c
  assert ok.any() and (ok == (steps[k_U, row_U] > 0)).all()
  assert (step_U[ok] < steps[k_U, row_U][ok]).all()
  assert float(batch["norm_B"][0]) == ok.sum()
  cache_U = losses.take_cache_rows(cache, jnp.asarray(row_U))
  logits = jax.jit(transformer.decode, static_argnums=1)(
      params, model_cfg, flat(batch["canvas_BxSxC"]), cache_U, jnp.asarray(prefix_U), None, None,
      flat(batch["self_cond_BxSxCxD"]))
  recorded = np.asarray(traj["argmax"])[k_U, np.maximum(step_U, 0), row_U]
  np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, -1))[ok], recorded[ok])
  # Targets: the last argmax of the canvas's trajectory.
  last = np.asarray(traj["argmax"])[k_U, np.maximum(steps[k_U, row_U] - 1, 0), row_U]
  np.testing.assert_array_equal(flat(batch["target_BxSxC"])[ok], last[ok])


def brute_force_weights(rewards_B, cfg: sdrl.SdrlConfig):
  """advantages() one row at a time in float64: group statistics by explicit loops."""
  g = cfg.group_size
  out = []
  for row, r in enumerate(np.asarray(rewards_B, np.float64)):
    group = [float(x) for x in rewards_B[row - row % g: row - row % g + g]]
    mean = sum(group) / g
    std = (sum((x - mean) ** 2 for x in group) / g) ** 0.5
    a = {"group_std": (r - mean) / (std + cfg.advantage_eps), "group_mean": r - mean,
         "none": r}[cfg.advantage_norm]
    if cfg.advantage_clip:
      a = min(max(a, -cfg.advantage_clip), cfg.advantage_clip)
    if a < 0:
      a *= cfg.negative_advantage_weight
    out.append(1.0 if cfg.mode == "distill" else a + cfg.reward_weight * r)
  return np.array(out)


def brute_force_states(traj, cfg: sdrl.SdrlConfig, num: int, p: int, c: int, tokens=None,
                       reference=None, use_reference=None):
  """prepare_states' deterministic selections one (row, canvas, state) at a time: the step of
  each state (-1: none), its input canvas, its target (the canvas's last argmax; a row that
  uses the reference: the reference's canvas, with no state after a committed canvas that
  differs from the reference's) and prefix."""
  argmax, canvas, ran = (np.asarray(traj[k]) for k in ("argmax", "canvas", "valid"))
  k_max, _, b = ran.shape
  step, target, state_canvas, prefix = {}, {}, {}, {}
  for row in range(b):
    for k in range(k_max):
      n = int(sum(bool(v) for v in ran[k, :, row]))
      by_reference = use_reference is not None and use_reference[row]
      if by_reference and any(list(tokens[row, j * c:(j + 1) * c])
                              != list(reference[row, j * c:(j + 1) * c]) for j in range(k)):
        n = 0  # a wrong context: the reference is not its continuation
      for m in range(num):
        pick = {"first_k": m if m < n else -1, "all": m if m < n else -1,
                "last_k": max(n - 1 - m, -1)}[cfg.state_selection]
        s = k * num + m
        step[row, s] = pick
        target[row, s] = (reference[row, k * c:(k + 1) * c] if by_reference
                          else argmax[k, max(n - 1, 0), row])
        state_canvas[row, s] = canvas[k, max(pick, 0), row]
        prefix[row, s] = p + k * c
  return step, target, state_canvas, prefix


@pytest.mark.parametrize(
    "selection, norm, neg_weight, clip, reward_weight, accum, target, certainty", [
        ("first_k", "group_std", 0.25, 0.0, 1.0, 1, "final", 0.0),
        ("last_k", "group_mean", 1.0, 0.3, 0.0, 2, "final", 0.7),
        ("all", "none", 0.0, 0.0, 0.5, 1, "final", 0.0),
        ("first_k", "none", 1.0, 0.0, 0.0, 1, "verified", 2.0)])
def test_prepared_weights_and_targets_equal_a_brute_force(rollout, selection, norm, neg_weight,
                                                          clip, reward_weight, accum, target,
                                                          certainty):
  """From a fixed rollout and fixed rewards, the states, targets, weights and normaliser that
  sdrl_loss trains on equal a loop-by-loop float64 computation, and so does the loss:
  sum over valid states of weight x mean CE toward the final canvas, over the valid count, and
  the certainty term: sum over valid states of max(weight, 0) x the mean over the canvas of
  the entropy at positions whose argmax is the target (0 elsewhere), over the same count.
  "verified": rows 1 and 3 are wrong; row 1's reference differs from its committed tokens in
  the second canvas only, row 3's in the first: row 1 keeps states on canvases 0 and 1 (those
  it ran), row 3 on canvas 0 only."""
  setup, params, out = rollout["setup"], rollout["params"], rollout["out"]
  model_cfg, scfg = setup.model_cfg, setup.run.stage_settings.rollout_sampler
  base = setup.run.stage_settings.cfg
  cfg = sdrl.SdrlConfig(group_size=base.group_size, prompts_per_rollout=base.prompts_per_rollout,
                        states_per_trajectory=2, state_selection=selection, advantage_norm=norm,
                        negative_advantage_weight=neg_weight, advantage_clip=clip,
                        reward_weight=reward_weight, certainty_weight=certainty)
  prompt, valid = rollout["prompt"], rollout["valid"]
  b, p, c = prompt.shape[0], prompt.shape[1], model_cfg.canvas_length
  rewards_B = np.array([0.75, 0.0, 1.0, 1.0])[:b]  # a group with a spread, one without
  weight_B = sdrl.advantages(rewards_B, cfg)
  expected_weight = brute_force_weights(rewards_B, cfg)
  np.testing.assert_allclose(np.asarray(weight_B, np.float64), expected_weight, rtol=1e-6,
                             atol=1e-6)
  tokens = np.asarray(out.tokens)
  reference = use_reference = None
  if target == "verified":
    reference = tokens.copy()
    reference[1, c + 3] = (reference[1, c + 3] + 1) % model_cfg.vocab_size
    reference[3, 5] = (reference[3, 5] + 1) % model_cfg.vocab_size
    use_reference = np.array([False, True, False, True])
  batch, _ = sdrl.prepare_states(params, model_cfg, scfg, cfg, accum, prompt, valid, out,
                                 weight_B, jax.device_put(jax.random.PRNGKey(0),
                                                          rollout["on_mesh"]), None,
                                 reference, use_reference)
  num = sdrl.num_states(cfg, scfg)
  step, targets, canvas, prefix = brute_force_states(out.trajectory, cfg, num, p, c, tokens,
                                                    reference, use_reference)
  if target == "verified":
    ran_KxB = np.asarray(out.trajectory["valid"]).sum(1) > 0
    kept = lambda row: sorted({s // num for (r, s), pick in step.items() if r == row and pick >= 0})
    assert kept(1) == [k for k in (0, 1) if ran_KxB[k, 1]] and kept(3) == [0]
    assert kept(0) == [k for k in range(3) if ran_KxB[k, 0]]
  got = {k: np.asarray(v) for k, v in batch.items()}
  assert got["valid_BxS"].shape == (b, 3 * num)
  count = 0
  for (row, s), pick in step.items():
    assert got["step_BxS"][row, s] == pick and got["valid_BxS"][row, s] == (pick >= 0)
    assert got["prefix_len_BxS"][row, s] == prefix[row, s]
    np.testing.assert_array_equal(got["target_BxSxC"][row, s], targets[row, s])
    if pick >= 0:
      np.testing.assert_array_equal(got["canvas_BxSxC"][row, s], canvas[row, s])
      count += 1
  np.testing.assert_allclose(got["weight_B"], expected_weight, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got["norm_B"], np.full(b, count / accum, np.float32))
  # The loss on that batch, state by state in float64 (each state decoded after its own cache).
  _, metrics = loss_fn(params, model_cfg, cfg, losses.LossConfig(), batch, jax.random.PRNGKey(0))
  cache = jax.jit(sdrl.encode_context, static_argnums=1)(
      params, model_cfg, prompt, valid, sdrl.context_tokens(out.tokens, model_cfg))
  total = certain = 0.0
  for (row, s), pick in step.items():
    if pick < 0:
      continue
    logits = jax.jit(transformer.decode, static_argnums=1)(
        params, model_cfg, jnp.asarray(canvas[row, s])[None],
        losses.take_cache_rows(cache, jnp.asarray([row])), jnp.asarray([prefix[row, s]]), None,
        None, got["self_cond_BxSxCxD"][row, s][None])
    logp = log_softmax64(logits)[0]
    ce = -np.mean([logp[i, targets[row, s][i]] for i in range(c)])
    total += expected_weight[row] * ce
    entropy = [-np.sum(np.exp(logp[i]) * logp[i]) if np.argmax(logp[i]) == targets[row, s][i]
               else 0.0 for i in range(c)]
    certain += max(expected_weight[row], 0.0) * np.mean(entropy)
  np.testing.assert_allclose(float(metrics["policy_loss"]), total / (count / accum), rtol=1e-5)
  if certainty:
    np.testing.assert_allclose(float(metrics["certainty_loss"]), certain / (count / accum),
                               rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(metrics["loss"]), float(metrics["policy_loss"])
                               + certainty * float(metrics["certainty_loss"]), rtol=1e-6)
    assert certain > 0  # some predictions are right, so the term is not vacuous
  else:
    assert "certainty_loss" not in metrics


def test_fused_step_self_conditioning_is_its_carried_embedding(params):
  scfg = sampler.SamplerConfig(fused_step=True)
  state = sampler.init_denoise_state(params, CFG, scfg, jax.random.PRNGKey(0), 2)
  emb = jnp.asarray(np.random.default_rng(0).normal(size=(2, CFG.canvas_length,
                                                          CFG.hidden_size)), jnp.float32)
  state = state._replace(self_cond_embedding_BxCxD=emb)
  np.testing.assert_array_equal(sdrl._self_cond_embedding(params, CFG, scfg, state), 0.0)
  state = state._replace(step=jnp.ones((), jnp.int32))  # the first step has none
  np.testing.assert_array_equal(sdrl._self_cond_embedding(params, CFG, scfg, state), emb)


def test_state_selection():
  n_KxB = jnp.asarray([[3, 0, 1]])
  last = sdrl.select_steps(n_KxB, None, sdrl.SdrlConfig(state_selection="last_k"), 2)
  np.testing.assert_array_equal(last[0], [[2, -1, 0], [1, -1, -1]])
  first = sdrl.select_steps(n_KxB, None, sdrl.SdrlConfig(state_selection="first_k"), 2)
  np.testing.assert_array_equal(first[0], [[0, -1, 0], [1, -1, -1]])
  every = sdrl.select_steps(n_KxB, None, sdrl.SdrlConfig(state_selection="all"), 4)
  np.testing.assert_array_equal(every[0], [[0, -1, 0], [1, -1, -1], [2, -1, -1], [-1, -1, -1]])
  uniform = np.asarray(sdrl.select_steps(n_KxB, jax.random.PRNGKey(0),
                                         sdrl.SdrlConfig(state_selection="uniform"), 200))[0]
  assert set(uniform[:, 0]) == {0, 1, 2} and set(uniform[:, 1]) == {-1}
  assert set(uniform[:, 2]) == {0}


# ----------------------------------------------------------------------------- rewards


def test_sudoku_rewards_on_known_grids():
  puzzles, solutions = sudoku_puzzles.generate_puzzles(3, 2, 40, 44)
  wrong_cell = solutions[0].copy()
  blank = int(np.flatnonzero(puzzles[0] == 0)[0])
  wrong_cell[blank] = wrong_cell[blank] % 9 + 1  # one blank cell wrong: duplicates in 3 units
  swapped = solutions[1].copy()  # a valid grid that breaks a given
  swapped = np.where(swapped == 1, 10, swapped)
  swapped = np.where(swapped == 2, 1, swapped)
  swapped = np.where(swapped == 10, 2, swapped)
  assert sudoku_puzzles.is_valid_solution(swapped)
  assert not sudoku_puzzles.batch_consistent(puzzles[1][None], swapped[None])[0]
  grids = np.stack([solutions[0], wrong_cell, swapped, np.zeros(81, np.int8)])
  puzzle_rows = np.stack([puzzles[0], puzzles[0], puzzles[1], puzzles[1]])
  prompts = sudoku.puzzle_prompts(puzzle_rows, np.stack([solutions[0]] * 2 + [solutions[1]] * 2),
                                  "digits")
  tokens = sudoku.solution_tokens(grids)
  tokens[3] = sudoku.PAD  # an empty canvas: every cell blank

  def run(step_penalty=0.0, length_penalty=0.0, **credit):
    config = tiny_configs()[1]
    config.rl.reward.update({"partial_credit": "none", **credit})
    score, correct = make_task(config).reward(prompts, tokens)
    shaping = rewards.ShapingConfig(step_penalty, length_penalty)
    return rewards.shape(shaping, score, correct, np.full(4, 6.0), np.full(4, 81), 48, 81)

  plain = run()
  np.testing.assert_array_equal(plain["correct"], [True, False, False, False])
  np.testing.assert_array_equal(plain["reward"], [1, 0, 0, 0])
  n_blank = [(puzzles[0] == 0).sum(), (puzzles[1] == 0).sum()]
  cells = run(partial_credit="cells", partial_weight=0.5)["reward"]
  ones_twos = ((solutions[1] == 1) | (solutions[1] == 2)) & (puzzles[1] == 0)
  np.testing.assert_allclose(cells, [1.0, 0.5 * (n_blank[0] - 1) / n_blank[0],
                                     0.5 * (n_blank[1] - ones_twos.sum()) / n_blank[1], 0.0])
  units = run(partial_credit="constraints", partial_weight=1.0)["reward"]
  # One wrong cell breaks its row, column and box.
  np.testing.assert_allclose(units[:2], [1.0, 24 / 27])
  given_12 = np.isin(puzzles[1], [1, 2]).reshape(9, 9)
  box_12 = given_12.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
  kept = 27 - given_12.any(1).sum() - given_12.any(0).sum() - box_12.any(1).sum()
  np.testing.assert_allclose(units[2:], [kept / 27, 0.0])
  shaped = run(step_penalty=0.48, length_penalty=0.1)["reward"]
  np.testing.assert_allclose(shaped, plain["reward"] - 0.48 * 6 / 48 - 0.1, rtol=1e-6)


def test_consistent_cells_against_brute_force():
  """Each cell checked by hand: a digit, its given kept, and alone in its row, column, box."""
  rng = np.random.default_rng(3)
  puzzles, solutions = sudoku_puzzles.generate_puzzles(5, 6, 30, 40)
  grids = solutions.copy()
  for grid in grids[1:]:  # row 0 stays solved; the others get wrong digits and blanks
    cells = rng.choice(81, size=rng.integers(1, 12), replace=False)
    grid[cells] = rng.integers(0, 10, len(cells))

  def brute(puzzle, grid):
    g = grid.reshape(9, 9)
    out = np.zeros((9, 9), bool)
    for r in range(9):
      for c in range(9):
        d = g[r, c]
        box = g[r // 3 * 3:r // 3 * 3 + 3, c // 3 * 3:c // 3 * 3 + 3]
        out[r, c] = (d != 0 and (g[r] == d).sum() == 1 and (g[:, c] == d).sum() == 1
                     and (box == d).sum() == 1 and puzzle[r * 9 + c] in (0, d))
    return out.reshape(81)

  got = sudoku_puzzles.consistent_cells(puzzles, grids)
  np.testing.assert_array_equal(got, [brute(p, g) for p, g in zip(puzzles, grids)])
  assert got[0].all() and not got[1:].all()
  tokens = sudoku.solution_tokens(grids)
  config = tiny_configs()[1]
  prompts = sudoku.puzzle_prompts(puzzles, solutions, "digits")
  np.testing.assert_array_equal(make_task(config).token_weights(prompts, tokens), got)


def test_the_task_section_rl_takes_a_metric_name_and_old_layouts_convert():
  """The stage reads only its own section (sdrl.shaping, not the task's rl.reward, which may be
  a metric name); a config saved with the task's keys inside `sdrl` loads in today's layout."""
  config = sdrl_chat.get_config()
  config.rl.reward = "exact"
  assert sdrl.settings(config).shaping == rewards.ShapingConfig()
  old = config.to_dict()
  del old["rl"], old["sdrl"]["shaping"]
  old["sdrl"].update(reward="exact", reward_fn="m:f")
  new = checkpointing.upgrade_layout(old)
  assert new["rl"] == {"reward": "exact", "reward_fn": "m:f"} and "shaping" not in new["sdrl"]
  assert sdrl.settings(ml_collections.ConfigDict(new)).shaping == rewards.ShapingConfig()
  old = sdrl_sudoku.get_config().to_dict()
  old["sdrl"].update(prompts=old.pop("rl")["prompts"], reward=dict(
      name="sudoku", partial_credit="cells", partial_weight=0.25, step_penalty=0.5,
      length_penalty=0.0))
  del old["sdrl"]["shaping"]
  new = ml_collections.ConfigDict(checkpointing.upgrade_layout(old))
  assert sdrl.settings(new).shaping == rewards.ShapingConfig(step_penalty=0.5)
  assert new.rl.reward.to_dict() == dict(name="sudoku", partial_credit="cells",
                                         partial_weight=0.25)
  assert new.rl.prompts.to_dict() == sdrl_sudoku.get_config().rl.prompts.to_dict()
  with pytest.raises(ValueError, match="unknown key sdrl.reward"):
    sdrl.settings(ml_collections.ConfigDict(dict(old, sdrl=dict(old["sdrl"], reward="exact"))))


def test_bad_config_values_fail_with_one_line():
  config = sdrl_sudoku.get_config()
  sdrl.settings(config)
  for key, value, words in (("mode", "ppo", "unknown sdrl.mode"),
                            ("state_selection", "first", "unknown sdrl.state_selection"),
                            ("cell_weighting", "all", "unknown sdrl.cell_weighting"),
                            ("updates_per_rollout", 3, "must be a multiple")):
    bad = sdrl_sudoku.get_config()
    bad.sdrl[key] = value
    with pytest.raises(ValueError, match=words):
      sdrl.settings(bad)
  bad = sdrl_sudoku.get_config()
  bad.rl.reward.partial_credit = "most"
  with pytest.raises(ValueError, match="partial_credit"):
    make_task(bad)


# ----------------------------------------------------------------------------- the loop


def test_loop_runs_from_a_tiny_sft_run_and_resumes_exactly(tmp_path):
  sft, config = tiny_configs()
  sft_dir = str(tmp_path / "sft")
  sft_params = save_sft_run(sft, sft_dir)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  last = loop.train(config, straight, init_from=sft_dir)
  for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/accuracy",
              "rollout/tokens_per_forward", "rollout/steps_per_canvas", "time/rollout_seconds",
              "time/sampling_share", "loss"):
    assert np.isfinite(last[key]), key
  assert last["states/replay_agreement"] == 1.0
  loop.train(config, resumed, stop_at=2, init_from=sft_dir)
  assert checkpointing.latest_step(resumed) == 2
  loop.train(config, resumed)
  invocations = provenance.load_run_info(resumed)["invocations"]  # run_info.json
  assert [(i["start_step"], i["end_step"], i["stop_reason"]) for i in invocations] == [
      (0, 2, provenance.STOP_AT), (2, 4, provenance.NUM_TRAIN_STEPS)]

  *_, a, _, step_a = restore_run(straight)
  *_, b, _, step_b = restore_run(resumed)
  assert step_a == step_b == 4
  chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(a["params"]["embedding"], sft_params["embedding"])  # it trained


def test_a_new_run_needs_init_from(tmp_path):
  _, config = tiny_configs()
  with pytest.raises(checkpointing.CheckpointError, match="--init_from"):
    loop.train(config, str(tmp_path / "run"))


# ----------------------------------------------------------------------------- one update step


def _stage_and_batch(config, sft_dir, accum):
  """An SD·RL stage over a fresh tiny state from `sft_dir`, and one rollout's update batch."""
  config = config.copy_and_resolve_references()
  config.grad_accum_steps = accum
  _, run, task, _, _ = loop.prepare_config(config, None, sft_dir)
  setup = training_state.make_setup(run)
  state, frozen = training_state.new_state(setup)
  stage = sdrl.SdrlStage(run.stage_settings, task, setup)
  stage.start(state, frozen, 0, sft_dir)
  batch, _ = stage.next_batch(0, state, frozen)
  return setup, stage, state, frozen, batch


def test_gradient_accumulation_equals_one_step_on_the_whole_batch(tmp_path):
  """Two micro-batches of the rollout's rows give the update of the whole batch: the loss is
  normalised by the whole batch's valid-state count (norm_B)."""
  sft, config = tiny_configs()
  sft_dir = str(tmp_path / "sft")
  save_sft_run(sft, sft_dir)
  config.sdrl.update({"mode": "both", "anchor": "none"})
  new_params = []
  for accum in (1, 2):
    setup, stage, state, frozen, batch = _stage_and_batch(config, sft_dir, accum)
    if accum == 2:
      assert float(batch["states"]["norm_B"][0]) * 2 == pytest.approx(norm_whole)
    norm_whole = float(batch["states"]["norm_B"][0])
    step = update_step.make_update_step(setup, stage.loss_fn, stream=stage.update_stream)
    state, metrics = step(state, frozen, batch)
    assert int(state["nonfinite"]) == 0
    new_params.append(state["params"])
  chex.assert_trees_all_close(*new_params, rtol=1e-5, atol=1e-7)


def test_lora_sdrl_trains_only_the_adapters(tmp_path):
  sft, config = tiny_configs()
  # Two layers: the one-layer initial model's rollouts all score alike, so every advantage is 0
  # and the adapters get no gradient in two steps (the run adopts its init's architecture).
  sft.model.num_layers = 2
  sft_dir = str(tmp_path / "sft")
  save_sft_run(sft, sft_dir)
  config.lora.update({"enabled": True, "rank": 2, "alpha": 4.0, "base_dtype": "float32"})
  config.optimizer.lr = 1e-2
  config.num_train_steps = 2
  workdir = str(tmp_path / "lora")
  loop.train(config, workdir, init_from=sft_dir)
  _, setup, state, frozen, _ = restore_run(workdir)
  assert set(state["params"]) == set(lora.target_paths(frozen, setup.lora_cfg))
  assert any(np.any(np.asarray(f["b"])) for f in state["params"].values())  # adapters moved
  base = model_dirs.load_workdir(sft_dir)[1]
  jax.tree_util.tree_map(np.testing.assert_array_equal, frozen, base)  # base untouched


_ONE_AND_TWO_DEVICES = """
import os, sys
import chex; chex.set_n_cpu_devices(2)  # two simulated host devices, before jax starts
sys.path.insert(0, os.getcwd())
import jax, numpy as np
from diffgemma.training import loop
from tests.helpers import restore_run, save_sft_run, tiny_configs

root = sys.argv[1]
sft, config = tiny_configs()
save_sft_run(sft, root + "/sft")
# The earlier objective over two rollouts (4 updates, a checkpoint between them), and the
# recipe's (verified targets, certainty forcing) over one: with it, the second rollout samples
# from parameters that differ in float rounding, and one draw at a near-tie then gives the two
# runs different trajectories to train on.
earlier = config.copy_and_resolve_references()
earlier.sdrl.update({"mode": "both", "target": "final", "certainty_weight": 0.0})
recipe = config.copy_and_resolve_references()
recipe.num_train_steps = 2
for name, objective in (("earlier", earlier), ("recipe", recipe)):
  finals = []
  for fsdp in (1, 2):
    run = objective.copy_and_resolve_references()
    run.sharding.fsdp = fsdp
    loop.train(run, f"{root}/{name}{fsdp}", init_from=root + "/sft")
    _, setup, state, _, _ = restore_run(f"{root}/{name}{fsdp}")
    assert setup.mesh.size == fsdp
    finals.append(jax.device_get(state["params"]))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0),
                         *finals)
print("ok")
"""


def test_sdrl_on_two_devices_matches_one_device(tmp_path):
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-c", _ONE_AND_TWO_DEVICES, str(tmp_path)], cwd=root,
                     capture_output=True, text=True, timeout=900,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_dry_run_plans_the_rollout_and_the_update_on_two_devices():
  """`train.py --dry_run` of an SD·RL config compiles both of its programs on a simulated mesh."""
  from tests.helpers import run
  r = run("train.py", "--config=sdrl_sudoku", "--dry_run", "--dry_run_devices=2",
          "--config.model.num_layers=1", "--config.model.layer_types=()")
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert "dry run: 2 devices" in out, out
  for program in ("update step", "rollout"):
    line = next(l for l in out.splitlines() if l.startswith(f"{program}: peak "))
    peak = float(line.split()[len(program.split()) + 1])
    assert 0 < peak < 1.0 and "fits" in line, line


def test_rollout_metrics_count_the_groups_with_a_spread():
  """Three groups of 3 rewards, counted by hand: (1, 0.5, 0.5) and (0.2, 0, 0) have a spread,
  (0, 0, 0) has none; of the correct flags only the first group is mixed."""
  reward = np.array([1, .5, .5, .2, 0, 0, 0, 0, 0], np.float32)
  rewarded = {"reward": reward, "score": reward, "correct": reward >= 1}
  stats = {"tokens_per_forward": np.ones(9), "steps_per_canvas": np.ones(9)}
  cfg = sdrl.SdrlConfig(group_size=3, prompts_per_rollout=3)
  metrics = sdrl._rollout_metrics(stats, rewarded, np.ones(9), cfg)
  assert metrics["rollout/groups_with_spread"] == pytest.approx(2 / 3)
  assert metrics["rollout/correct_groups_with_spread"] == pytest.approx(1 / 3)
  assert metrics["rollout/group_reward_std"] == pytest.approx(
      np.mean([np.std([1, .5, .5]), np.std([.2, 0, 0]), 0.0]))
  weight = np.array([2, -1, -1, 1, 0, 0, 0, 0, -0.5])  # |w| 5.5; rows 1..8 are wrong
  shares = sdrl._rollout_metrics(stats, rewarded, weight, cfg)
  assert shares["rollout/wrong_weight_share"] == pytest.approx(3.5 / 5.5)
  assert shares["rollout/negative_weight_share"] == pytest.approx(2.5 / 5.5)
