"""The sampler against transformers' reference pieces, and end to end on the tiny model."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.models.diffusion_gemma import generation_diffusion_gemma as ref

from diffgemma.model import config, transformer
from diffgemma.sampling import sampler

CFG = config.tiny()
EOS, PAD = CFG.eos_token_id, CFG.pad_token_id
# Near-one-hot logits: after tempering (t <= 0.8) the entropy is ~1e-19, far below 0.005.
CONFIDENT = 40.0


@pytest.fixture(scope="module")
def params():
  # An "rbg" key: threefry's op-by-op compiles make init several times slower on CPU.
  return transformer.init_params(CFG, jax.random.key(0, impl="rbg"))


@pytest.fixture
def patch_model(monkeypatch):
  """`patch_model(name, fn)` replaces a model function the sampler calls; JAX's trace caches are
  cleared afterwards so no later jit can reuse a program traced with the fake."""
  yield lambda name, fn: monkeypatch.setattr(sampler.transformer, name, fn)
  jax.clear_caches()


def one_hot_logits(tokens, vocab, scale=CONFIDENT):
  return scale * np.eye(vocab, dtype=np.float32)[np.asarray(tokens)]


# ----------------------------------------------------------------------------- per-step pieces


@pytest.mark.parametrize("n_max", [48, 7])
def test_temperature_matches_reference(n_max):
  cfg = sampler.SamplerConfig(max_denoising_steps=n_max)
  proc = ref.LinearTemperatureScheduleLogitsProcessor(cfg.t_min, cfg.t_max, n_max)
  scores = np.random.default_rng(0).normal(0, 5, (2, 3, 11)).astype(np.float32)
  for n in range(1, n_max + 1):
    theirs = proc(None, torch.tensor(scores), cur_step=torch.tensor(n, dtype=torch.int32))
    ours = scores / np.asarray(sampler.temperature(n, cfg))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, err_msg=f"step {n}")
  assert np.isclose(sampler.temperature(n_max, cfg), cfg.t_max)
  assert np.isclose(sampler.temperature(0, cfg), cfg.t_min)


def acceptance_cases():
  rng = np.random.default_rng(1)
  b, c, v = 5, 16, 64
  # Mixed scales: entropies from ~0 to log V on one canvas.
  mixed = rng.normal(0, 1, (b, c, v)) * rng.choice([0.1, 1, 5, 20, 60], (b, c, 1))
  # Exact ties (identical logits at every position; the bounds below cut inside each group):
  # entropy ~1.37 (bound 2 takes 2 of 16), ~0.065 (bounds 0.1 / 0.5 / 2 take 2 / 8 / 16), plus
  # all near-zero entropies, -inf logits, and all-uniform positions.
  ties = np.zeros((4, c, v))
  ties[0] = rng.normal(0, 1, v) * 8
  ties[1] = one_hot_logits(5, v, 9.2)
  ties[2] = one_hot_logits(rng.integers(0, v, c), v, 60.0)
  ties[3] = rng.normal(0, 1, (c, v)) * 4
  ties[3, :, 5:] = -np.inf  # zero-probability tokens
  uniform = np.zeros((1, c, v))
  return np.concatenate([mixed, ties, uniform]).astype(np.float32)


def test_entropy_and_acceptance_match_reference():
  logits = acceptance_cases()
  ours_entropy = np.asarray(sampler.token_entropy(jnp.asarray(logits)))
  theirs_entropy = torch.distributions.Categorical(logits=torch.tensor(logits)).entropy().numpy()
  np.testing.assert_allclose(ours_entropy, theirs_entropy, atol=1e-5, rtol=1e-5)
  assert np.all(np.isfinite(ours_entropy))

  b, c, v = logits.shape
  dummy = torch.zeros((b, c), dtype=torch.long)
  # From near zero (only zero-entropy prefixes) through the default to accept-everything.
  for bound in [1e-12, 0.1, 0.5, 2.0, 1e4]:
    eb = ref.EntropyBoundSampler(ref.EntropyBoundSamplerConfig(entropy_bound=float(bound)), c,
                                 v, 48)
    eb.accept_canvas(dummy, dummy, torch.tensor(logits), 0)
    theirs = eb.accepted_token_mask.numpy()
    ours = np.asarray(sampler.entropy_bounded_accept(jnp.asarray(ours_entropy), bound))
    np.testing.assert_array_equal(ours, theirs, err_msg=f"bound {bound}")
    assert ours.any(axis=-1).all()  # the lowest-entropy position is always accepted
  # Ties break by position, as torch's sort does: of 16 equal positions at entropy e with
  # 2e <= 0.1 < 3e, exactly the first three are accepted.
  e = np.full((1, 16), 0.04, np.float32)
  np.testing.assert_array_equal(np.asarray(sampler.entropy_bounded_accept(e, 0.1))[0],
                                np.arange(16) < 3)


def brute_force_accept_in_order(entropy_C, sampled_C, bound, stops):
  """stop_in_order's acceptance for one row, in plain Python: the reference acceptance of the
  positions sorted by (entropy, position); then stop tokens with an unkept position to their
  left are blocked and the acceptance is taken again over the other positions."""
  def accept(allowed):
    order = sorted((i for i in range(len(entropy_C)) if allowed[i]),
                   key=lambda i: (entropy_C[i], i))
    kept, total = set(), np.float32(0)
    for i in order:  # the prefix whose sum without its own entry stays <= bound
      if total > bound:
        break
      kept.add(i)
      total = np.float32(total + entropy_C[i])
    return kept
  first = accept([True] * len(entropy_C))
  blocked = {i for i in range(len(entropy_C))
             if sampled_C[i] in stops and any(j not in first for j in range(i))}
  kept = accept([i not in blocked for i in range(len(entropy_C))])
  return np.array([i in kept for i in range(len(entropy_C))])


def test_stops_in_order_keep_no_stop_right_of_an_unkept_position():
  rng = np.random.default_rng(0)
  stops = (EOS, 7)
  b, c = 64, 12
  entropy = rng.exponential(0.05, (b, c)).astype(np.float32)
  entropy[rng.random((b, c)) < 0.2] = 0.0  # ties broken by position
  sampled = np.where(rng.random((b, c)) < 0.4, rng.choice(stops, (b, c)), 20).astype(np.int32)
  for bound in (0.0, 0.1, 0.3, 1e4):
    ours = np.asarray(sampler.accept_in_order(jnp.asarray(entropy), jnp.asarray(sampled), bound,
                                              stops))
    for row in range(b):
      np.testing.assert_array_equal(
          ours[row], brute_force_accept_in_order(entropy[row], sampled[row], bound, stops),
          err_msg=f"bound {bound}, row {row}")
    unkept_left = np.cumsum(~ours, axis=-1) - ~ours > 0
    assert not (ours & np.isin(sampled, stops) & unkept_left).any()
    assert ours.any(axis=-1).all()  # every row keeps a position
  # A hand case: the confident EOS tail is blocked, the budget goes to the content instead.
  entropy = np.array([[0.3, 0.06, 0.01, 0.0, 0.0]], np.float32)
  sampled = np.array([[20, 21, EOS, EOS, EOS]], np.int32)
  np.testing.assert_array_equal(np.asarray(sampler.entropy_bounded_accept(entropy, 0.05))[0],
                                [False, True, True, True, True])
  np.testing.assert_array_equal(
      np.asarray(sampler.accept_in_order(entropy, sampled, 0.05, stops))[0],
      [False, True, False, False, False])


def brute_force_left_to_right(entropy_C, bound):
  """acceptance="left_to_right" for one row, in plain Python: walk the canvas from its left end
  and keep positions while the float32 entropy sum before each stays <= bound."""
  kept, total = [], np.float32(0)
  for e in entropy_C:
    if total > bound:
      break
    kept.append(True)
    total = np.float32(total + e)
  return np.array(kept + [False] * (len(entropy_C) - len(kept)))


def test_left_to_right_acceptance_keeps_a_run_from_the_left_end():
  rng = np.random.default_rng(2)
  b, c = 64, 12
  entropy = rng.exponential(0.05, (b, c)).astype(np.float32)
  entropy[rng.random((b, c)) < 0.3] = 0.0
  for bound in (0.0, 0.05, 0.1, 0.3, 1e4):
    ours = np.asarray(sampler.entropy_bounded_accept(jnp.asarray(entropy), bound,
                                                     left_to_right=True))
    for row in range(b):
      np.testing.assert_array_equal(ours[row], brute_force_left_to_right(entropy[row], bound),
                                    err_msg=f"bound {bound}, row {row}")
    assert ours[:, 0].all()  # the leftmost position is always kept
    assert (np.diff(ours.astype(int), axis=-1) <= 0).all()  # a run from the left, no gaps
  # A hand case: the reference keeps the confident right end, left_to_right the left run.
  entropy = np.array([[0.03, 0.03, 0.5, 0.0, 0.0]], np.float32)
  np.testing.assert_array_equal(np.asarray(sampler.entropy_bounded_accept(entropy, 0.05))[0],
                                [True, True, False, True, True])
  np.testing.assert_array_equal(
      np.asarray(sampler.entropy_bounded_accept(entropy, 0.05, left_to_right=True))[0],
      [True, True, False, False, False])


def test_left_to_right_generate_on_the_tiny_model(params):
  """A valid generation on the tiny model, and every step's accepted set a left run (counted
  through the step outputs of `denoise_canvas`)."""
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, CFG.vocab_size, (4, 6)), jnp.int32)
  cfg = sampler.SamplerConfig(max_denoising_steps=6, max_new_tokens=2 * CFG.canvas_length,
                              entropy_bound=0.5, acceptance="left_to_right")
  out = sampler.generate(params, CFG, cfg, prompt, jnp.ones((4, 6), bool), jax.random.PRNGKey(3))
  tokens = np.asarray(out.tokens)
  for row in tokens:
    ends = np.flatnonzero(row == EOS)
    if ends.size:
      assert (row[ends[0] + 1:] == PAD).all()
  np.testing.assert_array_equal(np.asarray(out.num_tokens), (tokens != PAD).sum(-1))
  with pytest.raises(ValueError, match="acceptance"):
    sampler.SamplerConfig(acceptance="random")


def brute_force_over_token_limit(entropy_C, sampled_C, limit, free_C, left_to_right):
  """max_same_token_per_step's excluded positions for one row, in plain Python: walk the free
  positions in the acceptance's order and exclude each whose token was already seen `limit`
  times."""
  free = [i for i in range(len(entropy_C)) if free_C[i]]
  order = free if left_to_right else sorted(free, key=lambda i: (entropy_C[i], i))
  seen, over = {}, np.zeros(len(entropy_C), bool)
  for i in order:
    over[i] = seen.get(sampled_C[i], 0) >= limit
    seen[sampled_C[i]] = seen.get(sampled_C[i], 0) + 1
  return over


def test_the_same_token_limit_keeps_the_first_in_the_acceptances_order():
  rng = np.random.default_rng(4)
  b, c = 48, 12
  entropy = rng.exponential(0.05, (b, c)).astype(np.float32)
  entropy[rng.random((b, c)) < 0.3] = 0.0  # ties broken by position
  sampled = rng.integers(20, 24, (b, c)).astype(np.int32)  # four tokens: many repeats
  free = rng.random((b, c)) < 0.8
  for limit in (1, 2, 3):
    for left_to_right in (False, True):
      for free_arg in (None, free):
        ours = np.asarray(sampler.over_token_limit(
            jnp.asarray(entropy), jnp.asarray(sampled), limit,
            None if free_arg is None else jnp.asarray(free_arg), left_to_right))
        row_free = np.ones((b, c), bool) if free_arg is None else free_arg
        for row in range(b):
          np.testing.assert_array_equal(
              ours[row], brute_force_over_token_limit(entropy[row], sampled[row], limit,
                                                      row_free[row], left_to_right),
              err_msg=f"limit {limit}, left_to_right {left_to_right}, row {row}")
  # A hand case: of three confident 'a's (20) at most one is kept; the bound then reaches 'b'.
  entropy = np.array([[0.0, 0.0, 0.01, 0.02, 0.3]], np.float32)
  sampled = np.array([[20, 20, 20, 21, 22]], np.int32)
  over = sampler.over_token_limit(entropy, sampled, 1)
  np.testing.assert_array_equal(np.asarray(over)[0], [False, True, True, False, False])
  ranked = jnp.where(over, jnp.inf, entropy)
  np.testing.assert_array_equal(
      np.asarray(sampler.entropy_bounded_accept(ranked, 0.05) & ~over)[0],
      [True, False, False, True, True])


def test_the_same_token_limit_on_the_tiny_model(params):
  """Every step keeps at most `limit` positions of any one token (read from the recorded
  trajectory: a kept draw is the next step's input at that position), the row still keeps one
  each step it runs, and the output is a valid generation."""
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, CFG.vocab_size, (4, 6)), jnp.int32)
  for limit in (1, 2):
    cfg = sampler.SamplerConfig(max_denoising_steps=6, max_new_tokens=2 * CFG.canvas_length,
                                entropy_bound=4.0, record_trajectory=True,
                                max_same_token_per_step=limit)
    out = sampler.generate(params, CFG, cfg, prompt, jnp.ones((4, 6), bool),
                           jax.random.PRNGKey(3))
    traj = jax.tree_util.tree_map(np.asarray, out.trajectory)
    kept_any = 0
    for k in range(traj["canvas"].shape[0]):
      for n in range(traj["canvas"].shape[1] - 1):
        for row in range(traj["canvas"].shape[2]):
          if not (traj["valid"][k, n, row] and traj["valid"][k, n + 1, row]):
            continue
          accepted = traj["accepted"][k, n, row]
          assert accepted.any()
          kept = traj["canvas"][k, n + 1, row][accepted]
          assert np.bincount(kept).max() <= limit, (limit, k, n, row, kept)
          kept_any += accepted.sum()
    assert kept_any
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), (tokens != PAD).sum(-1))
  with pytest.raises(ValueError, match="max_same_token_per_step"):
    sampler.SamplerConfig(mode="ar", max_same_token_per_step=1)
  with pytest.raises(ValueError, match="max_same_token_per_step"):
    sampler.SamplerConfig(max_same_token_per_step=-1)


def test_stops_in_order_generate_on_the_tiny_model(params):
  """On: a valid generation on the tiny model (tokens after a row's stop are pad; the counts
  agree). Off is the default acceptance, the code path the reference tests above check."""
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, CFG.vocab_size, (4, 6)), jnp.int32)
  cfg = sampler.SamplerConfig(max_denoising_steps=6, max_new_tokens=2 * CFG.canvas_length,
                              entropy_bound=0.5, stop_in_order=True)
  out = sampler.generate(params, CFG, cfg, prompt, jnp.ones((4, 6), bool), jax.random.PRNGKey(3))
  tokens = np.asarray(out.tokens)
  assert tokens.shape == (4, 2 * CFG.canvas_length)
  for row in tokens:
    ends = np.flatnonzero(row == EOS)
    if ends.size:
      assert (row[ends[0] + 1:] == PAD).all()
  np.testing.assert_array_equal(np.asarray(out.num_tokens), (tokens != PAD).sum(-1))
  with pytest.raises(ValueError, match="stop_in_order"):
    sampler.SamplerConfig(mode="ar", stop_in_order=True)


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_stopping_rule_matches_reference(stability):
  cfg = sampler.SamplerConfig(stability_threshold=stability)
  crit = ref.StableAndConfidentStoppingCriteria(stability, cfg.confidence_threshold)
  rng = np.random.default_rng(stability)
  b, c, v = 4, 6, 16
  base = rng.integers(0, v, (b, c))
  history = sampler.init_stability_history(b, c, cfg)
  for step in range(6):
    argmax = base.copy()
    argmax[1, step % c] = (base[1, step % c] + step) % v  # row 1 changes every step
    if step in (2, 3):
      argmax[2, 0] = (base[2, 0] + 1) % v  # row 2 changes at steps 2 and 4 only
    logits = one_hot_logits(argmax, v)
    logits[3] *= 0.05  # row 3 is stable but never confident
    if step == 4:
      logits[0, 0] = 0.0  # row 0 briefly unconfident (mean entropy log(V)/C)
    theirs = crit(torch.tensor(argmax), torch.tensor(logits)).numpy()
    ours, history = sampler.stable_and_confident(history, jnp.asarray(argmax, jnp.int32),
                                                 jnp.asarray(logits), cfg)
    np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=f"step {step}")


def test_finalize_matches_reference():
  c, v, prefix = 8, 16, 3
  rng = np.random.default_rng(0)
  canvas = rng.integers(2, v, (6, c))
  canvas[0, 3] = EOS  # EOS mid-canvas ...
  canvas[0, 6] = EOS  # ... and a second one after it
  canvas[1, 0] = EOS  # EOS first
  canvas[2, -1] = EOS  # EOS last
  canvas[3, 2] = EOS  # finished earlier: all pad regardless
  canvas[4, :] = EOS  # all EOS
  # row 5: no EOS
  prev_finished = np.array([False, False, False, True, False, False])
  for budget_reached in (False, True):
    ids = torch.tensor(np.concatenate([np.full((6, prefix), 7), canvas], 1))
    max_len = ids.shape[1] if budget_reached else ids.shape[1] + 1
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_len), EosTokenCriteria(EOS)])
    gen_cfg = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    theirs_ids, theirs_finished = ref.DiffusionGemmaGenerationMixin._finalize_canvas(
        ids.clone(), torch.tensor(prev_finished), gen_cfg, criteria, c, torch.tensor(EOS))
    ours_canvas, ours_finished = sampler.finalize_canvas(
        jnp.asarray(canvas, jnp.int32), jnp.asarray(prev_finished), budget_reached, CFG)
    np.testing.assert_array_equal(np.asarray(ours_canvas), theirs_ids[:, prefix:].numpy())
    np.testing.assert_array_equal(np.asarray(ours_finished), theirs_finished.numpy())


def test_finalize_with_stop_ids_matches_reference():
  """Extra stop ids (a chat model's end-of-turn) against the reference's list-valued
  eos_token_id: a row ends at the first of any of them; everything after it is pad."""
  c, v, prefix, eot = 8, 16, 3, 9
  stops = (EOS, eot)
  rng = np.random.default_rng(1)
  canvas = rng.integers(2, v, (5, c))
  canvas[canvas == eot] = 5
  canvas[0, 2], canvas[0, 5] = eot, EOS  # end-of-turn first, EOS after it
  canvas[1, 4], canvas[1, 6] = EOS, eot  # EOS first
  canvas[2, 0] = eot
  canvas[3, 7] = eot  # finished earlier: all pad regardless
  # row 4: neither
  prev_finished = np.array([False, False, False, True, False])
  ids = torch.tensor(np.concatenate([np.full((5, prefix), 7), canvas], 1))
  criteria = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 1),
                                   EosTokenCriteria(list(stops))])
  gen_cfg = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=list(stops))
  theirs_ids, theirs_finished = ref.DiffusionGemmaGenerationMixin._finalize_canvas(
      ids.clone(), torch.tensor(prev_finished), gen_cfg, criteria, c, torch.tensor(stops))
  ours_canvas, ours_finished = sampler.finalize_canvas(
      jnp.asarray(canvas, jnp.int32), jnp.asarray(prev_finished), False, CFG, stops)
  np.testing.assert_array_equal(np.asarray(ours_canvas), theirs_ids[:, prefix:].numpy())
  np.testing.assert_array_equal(np.asarray(ours_finished), theirs_finished.numpy())
  assert sampler.stop_ids(CFG, sampler.SamplerConfig(stop_token_ids=[eot, EOS])) == stops

def test_denoising_step_matches_reference_step(patch_model, monkeypatch):
  """Deterministic parts of the step (argmax, acceptance, accepted tokens, self-conditioning,
  finished rows and their freezing) against the reference `_denoising_step` on scripted logits;
  accepted positions are near one-hot so both samplers draw the same token there."""
  b, c, v, n_max, steps = 4, 8, 16, 6, 5
  cfg = sampler.SamplerConfig(max_denoising_steps=n_max)
  model_cfg = config.tiny(vocab_size=v, canvas_length=c)
  rng = np.random.default_rng(3)
  tgt = rng.integers(0, v, (b, c))
  script = []
  for s in range(steps):
    logits = rng.normal(0, 1, (b, c, v))  # row 3: never confident, some positions sharp
    logits[3, : c // 2] += one_hot_logits(tgt[3, : c // 2], v)
    logits[0] = one_hot_logits(tgt[0], v) if s < 2 else rng.normal(0, 3, (c, v))  # stops at 2
    logits[1] = one_hot_logits((tgt[1] + (s == 2)) % v, v)  # argmax changes twice: stops at 5
    # Row 2 is confident from step 4. (Noise keeps entropies apart: equal entropies from
    # permuted logits differ in the last bit, and the two sides could break such ties apart.)
    logits[2] = one_hot_logits(tgt[2], v) * (0.02 if s < 3 else 1.0) + rng.normal(0, 1, (c, v))
    script.append(logits.astype(np.float32))

  # Both fake decoders record the self-conditioning they are given and return the scripted
  # logits; ours gets them through the (otherwise unused) cache argument, so the step jits.
  ours_sc, theirs_sc = [], []

  def ours_decode(params, cfg, canvas, cache, prefix_len=None, sc=None, sc_mask=None):
    jax.debug.callback(lambda x, m: ours_sc.append(np.asarray(x) * np.asarray(m)[:, None, None]),
                       sc, sc_mask)
    return cache["logits"]

  def theirs_decode(self_conditioning_logits=None, **_):
    theirs_sc.append(None if self_conditioning_logits is None
                     else self_conditioning_logits.numpy())
    return types.SimpleNamespace(logits=torch.tensor(script[len(theirs_sc) - 1]))

  patch_model("decode", ours_decode)
  # A CUDA-graph marker, a no-op on CPU, that would import torch inductor (seconds).
  monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
  fake_self = types.SimpleNamespace(
      config=types.SimpleNamespace(text_config=types.SimpleNamespace(vocab_size=v)),
      model=types.SimpleNamespace(decoder=types.SimpleNamespace(
          embed_tokens=types.SimpleNamespace(weight=torch.zeros(1)))))
  eb = ref.EntropyBoundSampler(ref.EntropyBoundSamplerConfig(cfg.entropy_bound), c, v, n_max)
  processors = ref.LogitsProcessorList(
      [ref.LinearTemperatureScheduleLogitsProcessor(cfg.t_min, cfg.t_max, n_max)])
  stopper = ref.StableAndConfidentStoppingCriteria(cfg.stability_threshold,
                                                   cfg.confidence_threshold)

  params = {"embedding": jnp.zeros((v, 4), jnp.float32)}
  step_fn = jax.jit(lambda state, cache, key: sampler.denoising_step(
      params, model_cfg, cfg, cache, state, key))
  state = sampler.init_denoise_state(params, model_cfg, cfg, jax.random.PRNGKey(0), b)
  t_canvas = torch.tensor(np.asarray(state.canvas_BxC), dtype=torch.long)
  t_argmax, t_sc, t_finished = t_canvas, None, torch.zeros(b, dtype=torch.bool)
  for s in range(steps):
    prev_canvas, prev_t_canvas = np.asarray(state.canvas_BxC), t_canvas.numpy().copy()
    state, out = step_fn(state, {"logits": jnp.asarray(script[s])}, jax.random.PRNGKey(s + 1))
    t_canvas, t_argmax, t_sc, t_finished = ref.DiffusionGemmaGenerationMixin._denoising_step(
        fake_self, theirs_decode, t_canvas, t_argmax, None, None, t_sc, None, None,
        t_finished, n_max - s, eb, processors, stopper)
    msg = f"step {s + 1}"
    frozen = ~np.asarray(out.active_B)
    np.testing.assert_array_equal(np.asarray(state.argmax_BxC), t_argmax.numpy(), msg)
    np.testing.assert_array_equal(np.asarray(state.finished_B), t_finished.numpy(), msg)
    np.testing.assert_allclose(np.asarray(state.self_cond_BxCxV), t_sc.numpy(), rtol=1e-6,
                               err_msg=msg)
    accepted = np.asarray(out.accepted_BxC)
    np.testing.assert_array_equal(accepted, eb.accepted_token_mask.numpy() & ~frozen[:, None])
    sharp = accepted & (np.asarray(out.tempered_logits_BxCxV).max(-1) > 30)
    np.testing.assert_array_equal(np.asarray(state.canvas_BxC)[sharp], t_canvas.numpy()[sharp])
    # Frozen rows keep their canvas on both sides.
    np.testing.assert_array_equal(np.asarray(state.canvas_BxC)[frozen], prev_canvas[frozen])
    np.testing.assert_array_equal(t_canvas.numpy()[frozen], prev_t_canvas[frozen])
  np.testing.assert_array_equal(np.asarray(state.finished_B), [True, True, True, False])
  # The decoder saw the same self-conditioning: none first, then the previous tempered logits.
  jax.effects_barrier()
  assert len(ours_sc) == len(theirs_sc) == steps
  assert not ours_sc[0].any() and theirs_sc[0] is None
  for s in range(1, steps):
    np.testing.assert_allclose(ours_sc[s], theirs_sc[s], rtol=1e-6)


def test_denoise_canvas_per_row_stopping(params, patch_model):
  """Row 0 is confident with a fixed argmax: stops after 2 steps (step 1 is never stable) and
  stays frozen; row 1 is stable but never confident: runs all N steps; row 2 had already
  ended: no pass, canvas untouched."""
  b, c, v, n_max = 3, CFG.canvas_length, CFG.vocab_size, 5
  tgt = np.random.default_rng(0).integers(2, v, c)
  logits = np.zeros((b, c, v), np.float32)
  logits[0] = one_hot_logits(tgt, v)
  logits[1] = 0.01 * np.arange(v)  # nearly uniform, argmax v - 1
  patch_model("decode", lambda *a, **k: jnp.asarray(logits))
  cfg = sampler.SamplerConfig(max_denoising_steps=n_max, record_trajectory=True)
  cache = transformer.init_cache(CFG, b, 4)
  row_done = jnp.array([False, False, True])
  canvas, stats = jax.jit(lambda r: sampler.denoise_canvas(params, CFG, cfg, cache, r,
                                                           row_done))(jax.random.PRNGKey(0))
  canvas, traj = np.asarray(canvas), jax.tree_util.tree_map(np.asarray, stats["trajectory"])
  np.testing.assert_array_equal(stats["num_steps"], [2, n_max, 0])
  np.testing.assert_array_equal(traj["valid"].T, [[1, 1, 0, 0, 0], [1] * n_max, [0] * n_max])
  np.testing.assert_array_equal(canvas[0], tgt)
  np.testing.assert_array_equal(canvas[1], np.full(c, v - 1))
  # Row 0 after stopping: its canvas is the one the 2nd step produced, never touched again
  # (all positions accepted: it is the target); row 2 keeps its initial canvas throughout.
  for s in range(2, n_max):
    np.testing.assert_array_equal(traj["canvas"][s, 0], tgt)
    np.testing.assert_array_equal(traj["argmax"][s, 0], tgt)
  assert (traj["canvas"][:, 2] == traj["canvas"][0, 2]).all()
  assert traj["accepted"][:, 0].sum() == 2 * c and not traj["accepted"][:, 2].any()
  # Row 1 is renoised: its input canvas changes between steps.
  assert (traj["canvas"][1:, 1] != traj["canvas"][:-1, 1]).any()
  # The recorded entropy is the tempered one the acceptance ranked; zero where a row did not run.
  for s in range(n_max):
    t = sampler.temperature(n_max - s, cfg)
    np.testing.assert_allclose(traj["entropy"][s, 1],
                               sampler.token_entropy(jnp.asarray(logits[1]) / t), rtol=1e-5)
  assert not traj["entropy"][:, 2].any()


def test_settle_steps_on_a_hand_made_trajectory():
  """settle = 1 + the last step whose argmax differs from the row's final one (1-based: the
  step after it); 0 for a canvas the row did not run. Steps past a row's end are ignored."""
  a, b, x, y = [1, 1], [2, 2], [3, 3], [3, 4]
  argmax_KxNxBxC = np.array([
      [[a, x, a], [b, y, a], [b, x, a], [a, x, a]],  # canvas 0: steps n = 0..3, rows 0..2
      [[b, a, a], [a, a, a], [a, a, a], [a, a, a]],  # canvas 1
  ])
  valid_KxNxB = np.array([
      [[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 1, 0]],  # rows ran 3, 4, 0 steps
      [[1, 1, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]],  # rows ran 1, 2, 0 steps
  ], bool)
  settle = sampler.settle_steps({"argmax": jnp.asarray(argmax_KxNxBxC),
                                 "valid": jnp.asarray(valid_KxNxB)})
  # Row 0, canvas 0: final b (step 3 is past its end), differs at n = 0 -> 2. Row 1: final x,
  # differs at n = 1 -> 3. Row 0, canvas 1: one step -> 1. Row 1: never differs -> 1.
  np.testing.assert_array_equal(settle, [[2, 3, 0], [1, 1, 0]])


# ----------------------------------------------------------------------------- generate


PROMPT = np.array([[0, 0, 5, 6, 7], [9, 4, 5, 6, 7], [0, 10, 11, 12, 13]], np.int32)
VALID = PROMPT != PAD


def test_generate_bookkeeping_with_scripted_decoder(params, patch_model):
  """Exact per-row stats. Row 0 writes 3 tokens then EOS in canvas 0; row 1 is confident on
  every canvas (2 steps each) until the budget; row 2 is never confident (N steps each)."""
  c, v, n_max, p = CFG.canvas_length, CFG.vocab_size, 4, PROMPT.shape[1]
  rng = np.random.default_rng(0)
  row0 = rng.integers(2, v, c)
  row0[3] = EOS
  row1 = rng.integers(2, v, (3, c))  # one target per canvas

  def fake_decode(params, cfg, canvas, cache, *args):
    k = (cache["end"] - p) // c  # which canvas: the cache holds prompt + committed canvases
    logits = jnp.stack([jnp.asarray(one_hot_logits(row0, v)),
                        jnp.asarray(one_hot_logits(row1, v))[k],
                        jnp.broadcast_to(0.01 * jnp.arange(v, dtype=jnp.float32), (c, v))])
    return logits

  def fake_encode(params, cfg, tokens, cache, valid=None, images=None):
    hidden = jnp.zeros(tokens.shape + (cfg.hidden_size,))
    return hidden, {**cache, "end": cache["end"] + tokens.shape[1]}

  patch_model("decode", fake_decode)
  # Only the bookkeeping is under test: the encoder just advances the cache (fast to compile).
  patch_model("encode", fake_encode)
  cfg = sampler.SamplerConfig(max_denoising_steps=n_max, max_new_tokens=20,  # K = 3
                              record_trajectory=True)
  out = jax.tree_util.tree_map(np.asarray, sampler.make_generate_fn(CFG, cfg)(
      params, PROMPT, VALID, jax.random.PRNGKey(0)))
  expected_tokens = np.full((3, 3 * c), PAD)
  expected_tokens[0, :4] = row0[:4]
  expected_tokens[1] = row1.reshape(-1)
  expected_tokens[2] = v - 1
  np.testing.assert_array_equal(out.tokens, expected_tokens)
  np.testing.assert_array_equal(out.decoder_passes, [2, 6, 3 * n_max])
  np.testing.assert_array_equal(out.commit_passes, [0, 2, 2])
  np.testing.assert_array_equal(out.num_canvases, [1, 3, 3])
  np.testing.assert_array_equal(out.canvas_steps, [[2, 0, 0], [2, 2, 2], [n_max] * 3])
  np.testing.assert_array_equal(out.num_tokens, [4, 24, 24])
  np.testing.assert_allclose(out.steps_per_canvas, [2, 2, n_max])
  np.testing.assert_allclose(out.tokens_per_forward, [2, 4, 24 / (3 * n_max)])
  traj = out.trajectory
  assert traj["canvas"].shape == traj["argmax"].shape == (3, n_max, 3, c)
  np.testing.assert_array_equal(traj["valid"].sum(1).T, out.canvas_steps)
  # The last recorded argmax of each canvas is what was committed (before EOS padding).
  np.testing.assert_array_equal(traj["argmax"][:, -1, 1], row1)


def compile_generate(params, model_cfg, sampler_cfg):
  """`generate` as `make_generate_fn` jits it."""
  args = (params, model_cfg, sampler_cfg, PROMPT, VALID, jax.random.PRNGKey(0))
  return jax.jit(sampler.generate, static_argnums=(1, 2)).lower(*args).compile()


def test_generate_end_to_end_tiny_model(params):
  n_max = 6
  cfg = sampler.SamplerConfig(max_denoising_steps=n_max, max_new_tokens=20)
  fn = compile_generate(params, CFG, cfg)
  out = jax.tree_util.tree_map(np.asarray, fn(params, PROMPT, VALID, jax.random.PRNGKey(1)))
  again = jax.tree_util.tree_map(np.asarray, fn(params, PROMPT, VALID, jax.random.PRNGKey(1)))
  other = np.asarray(fn(params, PROMPT, VALID, jax.random.PRNGKey(2)).tokens)
  b, k, c = PROMPT.shape[0], 3, CFG.canvas_length
  chex.assert_trees_all_equal(out, again)  # same rng, same output
  assert not np.array_equal(out.tokens, other)
  tokens = out.tokens
  assert tokens.shape == (b, k * c) and tokens.dtype == np.int32
  assert ((tokens >= 0) & (tokens < CFG.vocab_size)).all()
  for row in range(b):
    eos_at = np.flatnonzero(tokens[row] == EOS)
    if eos_at.size:  # everything after the first EOS is pad, and the row stopped there
      assert (tokens[row, eos_at[0] + 1:] == PAD).all()
      assert out.num_canvases[row] == eos_at[0] // c + 1
    else:
      assert out.num_canvases[row] == k
  assert (out.decoder_passes >= out.num_canvases).all()
  assert (out.decoder_passes <= n_max * out.num_canvases).all()
  np.testing.assert_array_equal(out.decoder_passes, out.canvas_steps.sum(-1))
  np.testing.assert_array_equal(out.commit_passes, out.num_canvases - 1)
  np.testing.assert_array_equal(out.num_tokens, (tokens != PAD).sum(-1))
  np.testing.assert_allclose(out.tokens_per_forward,
                             out.num_tokens / out.decoder_passes, rtol=1e-6)
  np.testing.assert_allclose(out.steps_per_canvas,
                             out.decoder_passes / out.num_canvases, rtol=1e-6)


AR_MAX_NEW, AR_CANVASES = 12, 2


@pytest.fixture(scope="module")
def ar_loop_tokens(params):
  """[B, AR_MAX_NEW] greedy tokens of a plain Python loop of encode + argmax."""
  max_new, k = AR_MAX_NEW, AR_CANVASES
  b, p = PROMPT.shape
  cache = transformer.init_cache(CFG, b, p + k * CFG.canvas_length)
  encode = jax.jit(lambda t, cache, valid: transformer.encode(params, CFG, t, cache, valid)).lower(
      PROMPT[:, :1], cache, VALID[:, :1]).compile()
  # The prompt too goes one token at a time: one compiled shape, and an independent check of
  # the sampler's single prefill pass.
  for i in range(p):
    hidden, cache = encode(PROMPT[:, i:i + 1], cache, VALID[:, i:i + 1])
  loop_tokens = []
  for _ in range(max_new):
    token = np.asarray(jnp.argmax(transformer.lm_head(params, hidden[:, -1], CFG), -1))
    loop_tokens.append(token)
    hidden, cache = encode(token[:, None].astype(np.int32), cache, np.ones((b, 1), bool))
  return np.stack(loop_tokens, 1)


def test_generate_output_check_refuses_wrong_shapes_dtypes_and_fields():
  """What `generate` builds is checked (sampler._check_output): a field of the wrong dtype or
  shape, an optional field the mode does not fill, or one it fills left None, is refused."""
  b, l = 2, 2 * CFG.canvas_length
  ar_cfg = sampler.SamplerConfig(mode="ar", max_new_tokens=l)
  counts = {name: np.zeros(b, np.int32)
            for name in ("num_tokens", "decoder_passes", "commit_passes", "num_canvases")}
  ok = sampler.GenerateOutput(tokens=np.zeros((b, l), np.int32), **counts,
                              steps_per_canvas=np.ones(b, np.float32),
                              tokens_per_forward=np.ones(b, np.float32))
  sampler._check_output(ok, CFG, ar_cfg)
  sampler._check_output(ok.replace(canvas_steps=np.zeros((b, 2), np.int32)), CFG,
                        ar_cfg.replace(mode="diffusion"))
  bad = [(ok.replace(tokens=ok.tokens.astype(np.int64)), ar_cfg),
         (ok.replace(tokens=ok.tokens[:, 1:]), ar_cfg),
         (ok.replace(num_canvases=np.zeros(b, np.float32)), ar_cfg),
         (ok.replace(tokens_per_forward=np.ones(b + 1, np.float32)), ar_cfg),
         (ok.replace(canvas_steps=np.zeros((b, 2), np.int32)), ar_cfg),  # AR fills no steps
         (ok, ar_cfg.replace(mode="diffusion")),  # diffusion's canvas_steps missing
         (ok.replace(canvas_steps=np.zeros((b, 3), np.int32)), ar_cfg.replace(mode="diffusion"))]
  for out, cfg in bad:
    with pytest.raises(AssertionError):
      sampler._check_output(out, CFG, cfg)


@pytest.mark.parametrize("stop_via", ["eos_token_id", "stop_token_ids"])
def test_ar_mode_matches_python_loop(params, ar_loop_tokens, stop_via):
  """Greedy AR through the jitted sampler = a plain loop of encode + argmax on the same weights.
  EOS is set to a token the loop emits mid-sequence in row 1 (the network does not depend on
  the EOS id), so EOS and pad handling are exercised whatever the random weights; given as the
  model's eos_token_id, or as an extra stop id beside the model's own EOS."""
  max_new, k, loop_tokens = AR_MAX_NEW, AR_CANVASES, ar_loop_tokens
  b = PROMPT.shape[0]
  eos = next(int(t) for t in loop_tokens[1, 3:] if t != PAD)
  if stop_via == "eos_token_id":
    model_cfg, stops = CFG.replace(eos_token_id=eos), (eos,)
    cfg = sampler.SamplerConfig(mode="ar", max_new_tokens=max_new)
  else:
    model_cfg, stops = CFG, (CFG.eos_token_id, eos)
    cfg = sampler.SamplerConfig(mode="ar", max_new_tokens=max_new, stop_token_ids=(eos,))
  out = jax.tree_util.tree_map(np.asarray, compile_generate(params, model_cfg, cfg)(
      params, PROMPT, VALID, jax.random.PRNGKey(0)))
  expected = np.full((b, k * CFG.canvas_length), PAD)
  lengths = []
  for row in range(b):
    eos_at = np.flatnonzero(np.isin(loop_tokens[row], stops))
    n = eos_at[0] + 1 if eos_at.size else max_new
    expected[row, :n] = loop_tokens[row, :n]
    lengths.append(n)
  assert lengths[1] < max_new
  # AR fills only the fields every mode fills; to_dict drops the diffusion-only ones (None).
  assert list(out.to_dict()) == [
      "tokens", "num_tokens", "decoder_passes", "commit_passes", "num_canvases",
      "steps_per_canvas", "tokens_per_forward"]
  assert out.canvas_steps is None and out.ar_canvases is None and out.trajectory is None
  np.testing.assert_array_equal(out.tokens, expected)
  np.testing.assert_array_equal(out.decoder_passes, lengths)
  np.testing.assert_array_equal(out.commit_passes, 0)
  np.testing.assert_array_equal(out.num_tokens, (expected != PAD).sum(-1))
  np.testing.assert_allclose(out.tokens_per_forward,
                             out.num_tokens / out.decoder_passes, rtol=1e-6)
