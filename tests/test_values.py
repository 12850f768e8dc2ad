"""The values behind published figures, against independent readings.

* The SFT forward process (`losses.sample_draws`): every value against a float64 numpy reading
  of docs/design.md ("The objective"), given the same uniforms (exact), and in distribution
  (KS / chi-square / z tests at ALPHA, each with its power against a named wrong
  implementation computed in the test).
* The sampler's per-canvas step counts, token counts and TPF on scripted logits, against a
  brute-force per-row Python loop: exact.
* AR fallback ("unconverged", "entropy") with rows and canvases that decide differently, infill
  rows among them, against the same per-row loop: exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats

from diffgemma.model import config
from diffgemma.sampling import sampler
from diffgemma.tasks import Layout
from diffgemma.training import diffusion, losses

# A fixed-seed statistical check fails with probability ALPHA when the code is right.
ALPHA = 1e-3
# Every power stated below is at least this, against the wrong implementation it names.
POWER = 0.99

# ----------------------------------------------------------------------------- forward process

DRAW_CFG = config.tiny(canvas_length=4)  # sample_draws reads C, V and the EOS id only
EOS, V = DRAW_CFG.eos_token_id, DRAW_CFG.vocab_size


def alpha64(t, schedule):
  """P(a token survives to noise level t) in float64 (docs/design.md, `loss.noise_schedule`)."""
  t = np.asarray(t, np.float64)
  return 1.0 - t if schedule == "linear" else np.cos(0.5 * np.pi * t)


def t_cdf(t, eps, distribution):
  """CDF of the noise level: U(eps, 1), or t = sqrt(u) with u ~ U(eps, 1) ("sqrt")."""
  t = np.asarray(t, np.float64)
  u = t if distribution == "uniform" else t * t
  return np.clip((u - eps) / (1 - eps), 0.0, 1.0)


def sft_batch(rng, b, layout, replies):
  """tokens / valid / loss_mask of b rows: random prompt, a reply of replies[i % len] tokens
  (0 = none supervised) starting at its canvas 0, EOS fill to the end of its last canvas."""
  p, c = layout.prompt_len, layout.canvas_length
  tokens = rng.integers(2, V, (b, p + layout.response_len)).astype(np.int32)
  mask = np.zeros(tokens.shape, bool)
  for row in range(b):
    n = replies[row % len(replies)]
    filled = -(-n // c) * c
    tokens[row, p + n:p + filled] = EOS
    mask[row, p:p + filled] = True
  return {"tokens": jnp.asarray(tokens), "valid": jnp.ones(tokens.shape, bool),
          "loss_mask": jnp.asarray(mask)}


def reference_draws(rng, loss_cfg, layout, batch):
  """The forward process in float64 numpy from the uniforms JAX draws under `rng`.

  The key layout (split into canvas, t and noise keys; the noise key into keep and
  replacement keys; the canvas as the Gumbel-max draw over the example's supervised canvases)
  is read off the code: only the uniforms come from JAX, every value is computed here.
  Returns a dict per decoder row u: canvas [U], t [U], keep_u [U, C] (the keep uniforms),
  keep_prob [U] (alpha(t)), replacement [U, C], clean [U, C], target [U, C] (supervised).
  """
  tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["loss_mask"])
  b, (p, k_max, c) = tokens.shape[0], (layout.prompt_len, layout.num_canvases,
                                       layout.canvas_length)
  canvas_rng, t_rng, noise_rng = jax.random.split(rng, 3)
  if loss_cfg.canvas_selection == "one":
    gumbel = np.asarray(jax.random.gumbel(canvas_rng, (b, k_max)), np.float64)
    has = mask[:, p:].reshape(b, k_max, c).any(-1)
    canvas, row = np.argmax(np.where(has, gumbel, -np.inf), -1), np.arange(b)
  else:  # every canvas of every example, row u = b * K + k
    canvas, row = np.tile(np.arange(k_max), b), np.repeat(np.arange(b), k_max)
  u = canvas.shape[0]
  unit = np.asarray(jax.random.uniform(t_rng, (u,)), np.float64)
  t = loss_cfg.t_eps + (1 - loss_cfg.t_eps) * unit
  if loss_cfg.t_distribution == "sqrt":
    t = np.sqrt(t)
  keep_rng, replace_rng = jax.random.split(noise_rng)
  keep_u = np.asarray(jax.random.uniform(keep_rng, (u, c)), np.float64)
  replacement = np.asarray(jax.random.randint(replace_rng, (u, c), 0, V, jnp.int32))
  window = p + canvas[:, None] * c + np.arange(c)
  return dict(canvas=canvas, t=t, keep_u=keep_u, keep_prob=alpha64(t, loss_cfg.noise_schedule),
              replacement=replacement, clean=tokens[row[:, None], window],
              target=mask[row[:, None], window])


# One setting of each value per case: (canvas_selection, t_distribution, schedule, fill_noise).
DRAW_CASES = [("one", "uniform", "linear", "as_reply"), ("one", "sqrt", "cosine", "always"),
              ("all", "sqrt", "linear", "always"), ("all", "uniform", "cosine", "as_reply")]


@pytest.mark.parametrize("selection, distribution, schedule, fill", DRAW_CASES)
def test_draws_equal_the_float64_reading_on_a_fixed_key(selection, distribution, schedule, fill):
  """canvas and corruption exactly, t to 1e-6 (float32 rounding of eps + (1 - eps) u): every
  supervised token is kept iff its uniform < alpha(t) (only the fill, under "always", never
  is), else it becomes its replacement draw; unsupervised tokens stay clean. A keep decision
  may differ only where the uniform is within 1e-6 of alpha (float32 against float64)."""
  layout = Layout(prompt_len=2, num_canvases=3, canvas_length=DRAW_CFG.canvas_length)
  # Replies ending in each canvas, exactly at a canvas end, and one row with none supervised.
  batch = sft_batch(np.random.default_rng(0), 24, layout, (1, 4, 5, 8, 11, 12, 0, 3))
  loss_cfg = losses.LossConfig(canvas_selection=selection, t_distribution=distribution,
                               noise_schedule=schedule, fill_noise=fill, t_eps=0.05)
  rng = jax.random.PRNGKey(7)
  ours = jax.tree_util.tree_map(np.asarray,
                                losses.sample_draws(rng, DRAW_CFG, loss_cfg, layout, batch))
  ref = reference_draws(rng, loss_cfg, layout, batch)
  # A row with nothing supervised takes canvas 0 in both (every Gumbel score is -inf) and
  # stays clean (below).
  np.testing.assert_array_equal(ours.canvas_U, ref["canvas"])
  np.testing.assert_allclose(ours.t_U, ref["t"], rtol=0, atol=1e-6)
  keep = ref["keep_u"] < ref["keep_prob"][:, None]
  forced = ref["target"] & (ref["clean"] == EOS) if fill == "always" else False
  keep = (keep | ~ref["target"]) & ~forced
  expected = np.where(keep, ref["clean"], ref["replacement"])
  differs = ours.noisy_UxC != expected
  at_boundary = np.abs(ref["keep_u"] - ref["keep_prob"][:, None]) < 1e-6
  assert not (differs & ~at_boundary).any(), (
      f"noisy canvas differs from the float64 reading at {np.argwhere(differs & ~at_boundary)}")
  # The case is informative: tokens kept, replaced, and (under "always") fill forced.
  assert (keep & ref["target"]).any() and (~keep & (ref["replacement"] != ref["clean"])).any()
  if fill == "always":
    assert (forced & (ref["keep_u"] < ref["keep_prob"][:, None])).any()


@pytest.mark.parametrize("schedule", diffusion.SCHEDULES)
def test_keep_probability_by_schedule(schedule):
  """alpha(t) against float64 within 1e-6 (float32 rounding) on a grid including both ends."""
  t = np.concatenate([[0.0, 1e-3, 0.5, 1.0], np.random.default_rng(1).uniform(size=64)])
  got = np.asarray(diffusion.alpha(jnp.asarray(t, jnp.float32), schedule), np.float64)
  np.testing.assert_allclose(got, alpha64(t.astype(np.float32), schedule), rtol=0, atol=1e-6)
  assert got[0] == 1.0 and abs(got[3]) < 1e-6


def ks_power_floor(n, shift):
  """A lower bound on the power of the one-sample KS test at ALPHA with n draws against a
  distribution whose CDF differs from the null's by `shift` somewhere: the test rejects when
  the empirical CDF is within shift - critical value of the true one everywhere, which fails
  with probability <= 2 exp(-2 n d^2) (Dvoretzky-Kiefer-Wolfowitz, Massart's constant)."""
  critical = scipy.stats.kstwo.ppf(1 - ALPHA, n)
  return 1 - 2 * np.exp(-2 * n * max(shift - critical, 0.0) ** 2)


T_DRAWS = 8192


@pytest.fixture(scope="module")
def many_draws():
  """sample_draws over T_DRAWS rows for each t_distribution and schedule (no fill noise)."""
  layout = Layout(prompt_len=1, num_canvases=2, canvas_length=DRAW_CFG.canvas_length)
  batch = sft_batch(np.random.default_rng(2), T_DRAWS, layout, (8, 3))  # supervised: all, one
  out = {}
  for distribution in diffusion.T_DISTRIBUTIONS:
    for schedule in diffusion.SCHEDULES:
      loss_cfg = losses.LossConfig(t_distribution=distribution, noise_schedule=schedule)
      draws = losses.sample_draws(jax.random.PRNGKey(11), DRAW_CFG, loss_cfg, layout, batch)
      out[distribution, schedule] = jax.tree_util.tree_map(np.asarray, draws)
  return layout, jax.tree_util.tree_map(np.asarray, batch), out


@pytest.mark.parametrize("distribution", diffusion.T_DISTRIBUTIONS)
def test_noise_level_distribution(many_draws, distribution):
  """KS test of T_DRAWS noise levels against the stated CDF at ALPHA, inside its support.
  Power: any CDF off by >= `detectable` anywhere is rejected with probability >= POWER; the
  other setting's CDF (the planted bug "uniform drawn instead of sqrt", and back) is off by
  1/4, and the other setting's own draws are rejected here."""
  _, _, draws = many_draws
  eps = losses.LossConfig().t_eps
  t = draws[distribution, "linear"].t_U.astype(np.float64)
  result = scipy.stats.kstest(t, lambda x: t_cdf(x, eps, distribution))
  assert result.pvalue >= ALPHA, (f"t ~ {distribution}: KS D = {result.statistic:.4f}, "
                                  f"p = {result.pvalue:.2g} < {ALPHA}")
  low = eps if distribution == "uniform" else np.sqrt(eps)
  assert t.min() >= low * (1 - 1e-6) and t.max() <= 1.0
  critical = scipy.stats.kstwo.ppf(1 - ALPHA, T_DRAWS)
  detectable = critical + np.sqrt(np.log(2 / (1 - POWER)) / (2 * T_DRAWS))
  assert ks_power_floor(T_DRAWS, detectable) >= POWER - 1e-12 and detectable < 0.05
  other = "sqrt" if distribution == "uniform" else "uniform"
  grid = np.linspace(0, 1, 10001)
  planted_shift = np.abs(t_cdf(grid, eps, distribution) - t_cdf(grid, eps, other)).max()
  assert planted_shift > 0.24 and ks_power_floor(T_DRAWS, planted_shift) >= POWER
  wrong = draws[other, "linear"].t_U.astype(np.float64)
  p_wrong = scipy.stats.kstest(wrong, lambda x: t_cdf(x, eps, distribution)).pvalue
  assert p_wrong < ALPHA, f"draws of t_distribution={other!r} pass as {distribution}: p = " \
                          f"{p_wrong:.2g}"


@pytest.mark.parametrize("schedule", diffusion.SCHEDULES)
def test_kept_fraction_follows_alpha_of_t(many_draws, schedule):
  """Per quarter of the t range, the supervised tokens left unchanged number
  sum alpha(t) + (1 - alpha(t)) / V (a replacement is uniform, so it can equal the clean
  token) up to a two-sided z test at ALPHA / 4. Power: the other schedule's count is >= 6
  standard deviations away in some quarter (normal approximation: power >= POWER)."""
  layout, batch, draws = many_draws
  d = draws["uniform", schedule]
  p, c = layout.prompt_len, layout.canvas_length
  window = p + d.canvas_U[:, None] * c + np.arange(c)
  rows = np.arange(T_DRAWS)[:, None]
  clean, target = batch["tokens"][rows, window], batch["loss_mask"][rows, window]
  assert (d.noisy_UxC[~target] == clean[~target]).all()
  unchanged = (d.noisy_UxC == clean) & target
  t = d.t_U.astype(np.float64)
  z_crit = scipy.stats.norm.ppf(1 - ALPHA / 8)
  z_power = scipy.stats.norm.ppf(POWER)
  other = "cosine" if schedule == "linear" else "linear"
  separations = []
  for quarter in range(4):
    rows_q = (t >= 0.25 * quarter) & (t < 0.25 * (quarter + 1))
    n_q = target[rows_q].sum(-1)
    prob = alpha64(t[rows_q], schedule) + (1 - alpha64(t[rows_q], schedule)) / V
    mean, var = (n_q * prob).sum(), (n_q * prob * (1 - prob)).sum()
    z = (unchanged[rows_q].sum() - mean) / np.sqrt(var)
    assert abs(z) < z_crit, f"{schedule}, t in quarter {quarter}: z = {z:.2f}"
    wrong = alpha64(t[rows_q], other) + (1 - alpha64(t[rows_q], other)) / V
    separations.append(abs((n_q * wrong).sum() - mean) / np.sqrt(var))
  assert max(separations) >= z_crit + z_power, separations


def test_canvas_choice_is_uniform_among_supervised_canvases():
  """canvas_selection "one": chi-square of the chosen canvas per pattern of supervised canvases
  against uniform over them, at ALPHA; never an unsupervised canvas. Power: moving 0.1 of the
  probability from one supervised canvas to another is detected with probability >= POWER
  (noncentral chi-square)."""
  layout = Layout(prompt_len=1, num_canvases=4, canvas_length=2)
  patterns = np.array([[1, 1, 1, 1], [0, 1, 0, 1], [1, 0, 1, 1], [0, 0, 1, 0]], bool)
  rows_per_pattern = 1024
  b = len(patterns) * rows_per_pattern
  mask = np.zeros((b, 1 + 8), bool)
  mask[:, 1:] = np.repeat(np.tile(patterns, (rows_per_pattern, 1)), 2, axis=1)
  batch = {"tokens": jnp.full(mask.shape, 5, jnp.int32), "valid": jnp.ones(mask.shape, bool),
           "loss_mask": jnp.asarray(mask)}
  cfg = config.tiny(canvas_length=2)
  canvas = np.asarray(losses.sample_draws(jax.random.PRNGKey(3), cfg, losses.LossConfig(),
                                          layout, batch).canvas_U)
  for i, allowed in enumerate(patterns):
    counts = np.bincount(canvas[i::len(patterns)], minlength=4)
    assert counts[~allowed].sum() == 0, f"pattern {allowed}: unsupervised canvas chosen {counts}"
    m = allowed.sum()
    if m == 1:
      continue
    p_value = scipy.stats.chisquare(counts[allowed]).pvalue
    assert p_value >= ALPHA, f"pattern {allowed.astype(int)}: counts {counts}, p = {p_value:.2g}"
    noncentrality = rows_per_pattern * 2 * 0.1 ** 2 * m  # n * sum (p1 - p0)^2 / p0
    critical = scipy.stats.chi2.ppf(1 - ALPHA, m - 1)
    assert scipy.stats.ncx2.sf(critical, m - 1, noncentrality) >= POWER


def test_fill_under_always_is_noise_at_any_t(many_draws):
  """fill_noise "always": the scored canvas's EOS fill is replaced whatever t is, so it stays
  EOS only when its replacement draw is EOS: a binomial test of 1/V at ALPHA. Power: "as_reply"
  fill (unchanged with probability alpha(t) + (1 - alpha(t)) / V, 0.26 on average for t in
  (0.5, 1)) would leave a count whose probability under 1/4 is below 1e-12."""
  layout, batch, _ = many_draws
  loss_cfg = losses.LossConfig(fill_noise="always", t_eps=0.5)  # t in (0.5, 1): alpha < 1/2
  d = jax.tree_util.tree_map(np.asarray, losses.sample_draws(
      jax.random.PRNGKey(12), DRAW_CFG, loss_cfg, layout, jax.tree_util.tree_map(jnp.asarray,
                                                                                 batch)))
  window = (layout.prompt_len + d.canvas_U[:, None] * layout.canvas_length
            + np.arange(layout.canvas_length))
  rows = np.arange(T_DRAWS)[:, None]
  fill = (batch["tokens"][rows, window] == EOS) & batch["loss_mask"][rows, window]
  n, stayed = int(fill.sum()), int((d.noisy_UxC[fill] == EOS).sum())
  assert n > 1000
  assert scipy.stats.binomtest(stayed, n, 1 / V).pvalue >= ALPHA, (stayed, n)
  assert scipy.stats.binom.cdf(stayed, n, 0.25) < 1e-12  # far below any "as_reply" fill


def reply_end_by_loop(tokens, mask, eos):
  """The reply end per row, brute force: the last supervised position whose token is not EOS."""
  end = np.zeros(tokens.shape, bool)
  for row in range(tokens.shape[0]):
    for j in reversed(range(tokens.shape[1])):
      if mask[row, j] and tokens[row, j] != eos:
        end[row, j] = True
        break
  return end


def test_end_weights_against_a_loop():
  """token_weights: end_weight exactly at the brute-force reply end, 1 elsewhere, on random
  rows: EOS inside the reply, scattered supervision, all-EOS and unsupervised rows."""
  rng = np.random.default_rng(4)
  tokens = rng.choice([EOS, 2, 3, 7, 40], size=(256, 12), p=[0.4, 0.15, 0.15, 0.15, 0.15])
  mask = rng.random(tokens.shape) < 0.6
  tokens[0], mask[1] = EOS, False
  end = reply_end_by_loop(tokens, mask, EOS)
  assert end.any(1).sum() > 200 and not end[:2].any()
  weights = np.asarray(losses.token_weights(jnp.asarray(tokens, jnp.int32), jnp.asarray(mask),
                                            EOS, 6.5))
  np.testing.assert_array_equal(weights, np.where(end, 6.5, 1.0))


# ----------------------------------------------------------------------------- the sampler

# The network is scripted (`scripted_model`); the sampler only reads the embedding's dtype.
SAMPLE_CFG = config.tiny(num_layers=1, layer_types=())  # canvas 8, vocab 64
C, PAD, PROMPT_LEN = SAMPLE_CFG.canvas_length, SAMPLE_CFG.pad_token_id, 3
assert SAMPLE_CFG.eos_token_id == EOS and SAMPLE_CFG.vocab_size == V
EXTRA_STOP = 3  # a stop id besides EOS (SamplerConfig.stop_token_ids)
# How a canvas's scripted decoder logits look at every step (the argmax never changes):
#   sharp: one-hot x 40 (entropy ~0: stops as soon as the argmax is stable, step 2);
#   graded: one-hot x a per-canvas scale in [5.5, 9]: its tempered entropy crosses the
#     confidence threshold while the temperature falls, at a step that varies;
#   flat: near-uniform logits (entropy ~4 at every step: never stops);
#   one_flat / half_flat: sharp but 1 / 3 positions flat (mean entropy ~0.5 / ~1.5).
FLAT_POSITIONS = {"sharp": 0, "graded": 0, "flat": C, "one_flat": 1, "half_flat": 3}


def scripted_logits(spec, seed):
  """Decoder logits [K, B, C, V] float32 from spec[b][k] = kind or (kind, position, stop id):
  random non-stop targets (ids >= 4), the stop id (if any) as the target at that position."""
  rng = np.random.default_rng(seed)
  b, k_max, v = len(spec), len(spec[0]), SAMPLE_CFG.vocab_size
  logits = np.zeros((k_max, b, C, v), np.float32)
  for row, canvases in enumerate(spec):
    for k, entry in enumerate(canvases):
      kind, *stop = (entry,) if isinstance(entry, str) else entry
      target = rng.integers(4, v, C)
      if stop:
        target[stop[0]] = stop[1]
      scale = rng.uniform(5.5, 9.0) if kind == "graded" else 40.0
      out = scale * np.eye(v)[target]
      flat = rng.permutation(C)[:FLAT_POSITIONS[kind]]
      noise = 0.3 * rng.normal(size=(len(flat), v))
      noise[np.arange(len(flat)), target[flat]] = noise.max(-1) + 0.5  # the argmax stays
      out[flat] = noise
      logits[k, row] = out
  return logits


@pytest.fixture
def scripted_model(monkeypatch):
  """`scripted_model(decode_KxBxCxV, ar_tokens_BxL)` replaces the network the sampler calls:
  the decoder returns canvas k's logits at every step (k from the cache's end), the encoder
  only advances the cache (its hidden state holds each token's slot), and the next-token head
  after slot s is one-hot at ar_tokens[b, s + 1 - P] (the AR token of that reply slot).
  JAX's trace caches are cleared afterwards so no later jit reuses a program traced with it."""

  def install(decode_KxBxCxV, ar_tokens_BxL):
    decode_KxBxCxV = jnp.asarray(decode_KxBxCxV)
    ar_BxLxV = 10.0 * jax.nn.one_hot(ar_tokens_BxL, SAMPLE_CFG.vocab_size)
    rows = jnp.arange(ar_BxLxV.shape[0])

    def decode(params, cfg, canvas, cache, *args):
      return decode_KxBxCxV[(cache["end"] - PROMPT_LEN) // C]

    def encode(params, cfg, tokens, cache, valid=None, images=None):
      slots = cache["end"] + jnp.arange(tokens.shape[1], dtype=jnp.float32)
      hidden = jnp.broadcast_to(slots[None, :, None], tokens.shape + (cfg.hidden_size,))
      return hidden, {**cache, "end": cache["end"] + tokens.shape[1]}

    def lm_head(params, hidden_BxD, cfg):
      slot = jnp.clip(hidden_BxD[:, 0].astype(jnp.int32) + 1 - PROMPT_LEN, 0,
                      ar_BxLxV.shape[1] - 1)
      return ar_BxLxV[rows, slot]

    for name, fn in (("decode", decode), ("encode", encode), ("lm_head", lm_head)):
      monkeypatch.setattr(sampler.transformer, name, fn)

  yield install
  jax.clear_caches()


def run_scripted(sampler_cfg, batch, fixed=None):
  """`generate` on the scripted model: its GenerateOutput as numpy."""
  params = {"embedding": jnp.zeros((SAMPLE_CFG.vocab_size, SAMPLE_CFG.hidden_size))}
  prompt = np.full((batch, PROMPT_LEN), 5, np.int32)
  args = (params, prompt, np.ones(prompt.shape, bool), jax.random.PRNGKey(0))
  if fixed is not None:
    args += fixed
  out = sampler.make_generate_fn(SAMPLE_CFG, sampler_cfg)(*args)
  return jax.tree_util.tree_map(np.asarray, out)


def entropy64(logits_CxV, temperature):
  z = logits_CxV.astype(np.float64) / temperature
  logp = z - scipy.special.logsumexp(z, axis=-1, keepdims=True)
  return -(np.exp(logp) * logp).sum(-1)


def clear_of(value, threshold, what):
  """value vs threshold, refusing a comparison that float32 rounding could flip."""
  assert abs(value - threshold) > 1e-3 * threshold, f"{what}: {value} too close to {threshold}"
  return value < threshold


def brute_force_generate(decode_KxBxCxV, ar_tokens_BxL, cfg: sampler.SamplerConfig,
                         fixed=None):
  """What `generate` must return on the scripted model, row by row in float64 Python
  (docs/design.md "The sampler"; SamplerConfig's fields):

  per canvas, step n = 1, 2, ... runs at temperature t_min + (t_max - t_min) (N - n + 1) / N;
  the row stops after step n when its argmax canvas has been the same for S steps (n > S: the
  scripted argmax never changes) and its mean tempered entropy (0 at infill's fixed slots) is
  below confidence_threshold, else it runs N steps. AR fallback: "unconverged" = ran N steps
  without stopping; "entropy" = not stopped at step ar_fallback_after_steps with mean entropy
  above ar_fallback_entropy (denoising ends there). A fallen-back canvas is AR decoded: slot j
  emits ar_tokens[j] (its fixed token at a fixed slot), one forward each, until a stop. The
  committed canvas (the argmax with fixed tokens, or the AR canvas) ends the row at its first
  stop id at or after the row's last fixed slot (pads after it), or at the token budget.
  """
  k_max, b = decode_KxBxCxV.shape[:2]
  n_max, s_hist = cfg.max_denoising_steps, cfg.stability_threshold
  stops = {EOS, *cfg.stop_token_ids}
  out = {key: np.zeros(b, np.int64) for key in ("num_tokens", "decoder_passes", "commit_passes",
                                                "num_canvases", "ar_canvases", "ar_passes")}
  out.update(tokens=np.full((b, k_max * C), PAD), canvas_steps=np.zeros((b, k_max), np.int64),
             canvas_ar=np.zeros((b, k_max), bool))
  for row in range(b):
    fixed_tok = np.zeros(k_max * C, np.int64) if fixed is None else fixed[0][row]
    fixed_mask = np.zeros(k_max * C, bool) if fixed is None else fixed[1][row]
    last_fixed = np.flatnonzero(fixed_mask).max(initial=-1)
    for k in range(k_max):
      slots = range(k * C, (k + 1) * C)
      mask_c = fixed_mask[k * C:(k + 1) * C]
      logits = decode_KxBxCxV[k, row]
      steps, fell_back = n_max, cfg.ar_fallback == sampler.FALLBACK_UNCONVERGED
      for n in range(1, n_max + 1):
        temp = cfg.t_min + (cfg.t_max - cfg.t_min) * (n_max - n + 1) / n_max
        mean_entropy = np.where(mask_c, 0.0, entropy64(logits, temp)).mean()
        if n > s_hist and clear_of(mean_entropy, cfg.confidence_threshold, "stop test"):
          steps, fell_back = n, False
          break
        if (cfg.ar_fallback == sampler.FALLBACK_ENTROPY and n == cfg.ar_fallback_after_steps
            and not clear_of(mean_entropy, cfg.ar_fallback_entropy, "fallback test")):
          steps, fell_back = n, True
          break
      out["num_canvases"][row] += 1
      out["canvas_steps"][row, k] = steps
      out["decoder_passes"][row] += steps
      canvas = np.where(mask_c, fixed_tok[k * C:(k + 1) * C], logits.argmax(-1))
      if fell_back:
        canvas = np.full(C, PAD)
        for t, j in enumerate(slots):
          canvas[t] = fixed_tok[j] if fixed_mask[j] else ar_tokens_BxL[row, j]
          out["ar_passes"][row] += 1
          if canvas[t] in stops and j > last_fixed:
            break
        out["ar_canvases"][row] += 1
        out["canvas_ar"][row, k] = True
      ends = [t for t, j in enumerate(slots) if canvas[t] in stops and j > last_fixed]
      if ends:
        canvas[ends[0] + 1:] = PAD
      out["tokens"][row, k * C:(k + 1) * C] = canvas
      if ends or (k + 1) * C >= cfg.max_new_tokens:
        break
      out["commit_passes"][row] += 1
  out["decoder_passes"] += out["ar_passes"]
  out["num_tokens"] = ((out["tokens"] != PAD) & ~(np.zeros_like(out["tokens"], bool)
                                                   if fixed is None else fixed[1])).sum(-1)
  out["steps_per_canvas"] = out["decoder_passes"] / out["num_canvases"]
  out["tokens_per_forward"] = out["num_tokens"] / out["decoder_passes"]
  return out


def assert_same_rows(got: sampler.GenerateOutput, expected: dict, keys):
  for key in keys:
    if key in ("steps_per_canvas", "tokens_per_forward"):  # float32 ratios of exact counts
      np.testing.assert_allclose(getattr(got, key), expected[key], rtol=1e-6, err_msg=key)
    else:
      np.testing.assert_array_equal(getattr(got, key), expected[key], err_msg=key)


# In the order compared: a failure names the first quantity that differs.
COUNTS = ("num_canvases", "canvas_steps", "decoder_passes", "commit_passes", "num_tokens",
          "steps_per_canvas", "tokens_per_forward", "tokens")
# Rows of the step-count check: (kind, position, stop id) puts a stop at that position.
TPF_SPEC = [
    ["sharp", ("graded", 4, EXTRA_STOP), "flat"],  # ends in canvas 1 (extra stop id)
    ["graded", "graded", "graded"],  # the token budget
    [("flat", 6, EOS), "sharp", "sharp"],  # ends after N steps
    [("sharp", 0, EOS), "flat", "flat"],  # one token
    ["one_flat", "sharp", "graded"],
    ["graded", "half_flat", ("sharp", C - 1, EOS)],
]


def test_step_counts_and_tpf_equal_a_brute_force_loop(scripted_model):
  """Per row and canvas: the denoising steps, the committed tokens, the canvases run, the
  passes and TPF = generated tokens / decoder passes, exactly as the brute-force loop says
  (ratios to float32 rounding), on scripted logits with rows that stop at varied steps, end in
  different canvases (EOS, an extra stop id, the budget) or never converge."""
  decode = scripted_logits(TPF_SPEC, seed=0)
  k_max = len(TPF_SPEC[0])
  cfg = sampler.SamplerConfig(max_denoising_steps=8, max_new_tokens=k_max * C,
                              stop_token_ids=(EXTRA_STOP,))
  ar_tokens = np.full((len(TPF_SPEC), k_max * C), 4)  # unused without ar_fallback
  scripted_model(decode, ar_tokens)
  expected = brute_force_generate(decode, ar_tokens, cfg)
  # The script is informative: several step counts, rows ending in each canvas.
  steps = expected["canvas_steps"][expected["canvas_steps"] > 0]
  assert {2, cfg.max_denoising_steps} < set(steps) and len(set(steps)) >= 4
  assert set(expected["num_canvases"]) == {1, 2, 3}
  assert_same_rows(run_scripted(cfg, len(TPF_SPEC)), expected, COUNTS)


# Rows of the fallback check, the last four with infill's fixed slots (FALLBACK_FIXED). Under
# "entropy" (after 3 steps, threshold 1): flat and half_flat canvases fall back, one_flat ones
# do not (mean ~0.5, max ~4) and run N steps; under "unconverged" all three fall back.
FALLBACK_SPEC = [
    ["flat", "sharp", "graded"],
    ["sharp", "one_flat", "flat"],
    ["graded", "half_flat", "sharp"],
    ["sharp", "graded", "sharp"],  # never falls back, beside rows that do
    ["flat", ("graded", 2, EOS), "sharp"],  # EOS after the fixed prefix: ends the row
    ["flat", ("sharp", 0, EOS), "graded"],  # EOS before the fixed suffix: only a token
    ["flat", "sharp", "sharp"],  # 7 of canvas 0's 8 slots fixed: mean entropy ~0.5
    ["half_flat", "flat", "one_flat"],
]
FALLBACK_FIXED = {4: range(0, 3), 5: range(10, 13), 6: range(0, 7), 7: range(17, 20)}
# Stop ids in the AR tokens: (row, reply slot, id); those before a row's last fixed slot do not
# end it, and a fixed slot overrides its AR token.
AR_STOPS = [(1, 20, EOS), (2, 9, EXTRA_STOP), (4, 1, EOS), (5, 4, EOS), (6, 7, EOS), (7, 16, EOS)]


@pytest.mark.parametrize("rule", [sampler.FALLBACK_UNCONVERGED, sampler.FALLBACK_ENTROPY])
def test_ar_fallback_per_row_and_canvas_equals_a_brute_force_loop(scripted_model, rule):
  """Which canvases of which rows fall back, their AR tokens and passes, and every count and
  TPF, exactly as the brute-force per-row loop decides, when rows and canvases of one batch
  decide differently, infill rows among them."""
  b, k_max = len(FALLBACK_SPEC), len(FALLBACK_SPEC[0])
  decode = scripted_logits(FALLBACK_SPEC, seed=1)
  ar_tokens = np.random.default_rng(2).integers(4, SAMPLE_CFG.vocab_size, (b, k_max * C))
  for row, slot, stop in AR_STOPS:
    ar_tokens[row, slot] = stop
  fixed_mask = np.zeros((b, k_max * C), bool)
  for row, slots in FALLBACK_FIXED.items():
    fixed_mask[row, list(slots)] = True
  fixed = (np.where(fixed_mask, np.random.default_rng(3).integers(4, 60, fixed_mask.shape), PAD)
           .astype(np.int32), fixed_mask)
  cfg = sampler.SamplerConfig(max_denoising_steps=8, max_new_tokens=k_max * C,
                              stop_token_ids=(EXTRA_STOP,), ar_fallback=rule,
                              ar_fallback_entropy=1.0, ar_fallback_after_steps=3)
  scripted_model(decode, ar_tokens)
  expected = brute_force_generate(decode, ar_tokens, cfg, fixed)
  ran = expected["canvas_steps"] > 0
  ar = expected["canvas_ar"]
  # The script is informative: in some canvas rows that ran split both ways, a row mixes AR
  # and diffused canvases, infill rows fall back, and AR decoding ends some rows early.
  assert any(ar[:, k].any() and (ran[:, k] & ~ar[:, k]).any() for k in range(k_max))
  assert (ar.any(1) & (ran & ~ar).any(1)).any() and ar[list(FALLBACK_FIXED)].any()
  assert (expected["ar_passes"] % C != 0).any()
  got = run_scripted(cfg, b, fixed)
  assert_same_rows(got, expected, ("canvas_ar", "ar_canvases", "ar_passes") + COUNTS)
