"""Our sampler and the transformers reference's `generate` on the same weights, row by row.

Shared by `benchmarks/vs_transformers.py` and `tests/test_sampler_stats.py`:
  * `reference_model` builds a random reference DiffusionGemma (a one-layer vision tower: the
    default one has 167M unused parameters) and `load_ours` loads the same weights into ours;
  * `bias_to_copy_` reshapes the random weights so that adaptive stopping happens at varied
    steps (random weights alone run every canvas to the step limit);
  * `reference_generate` runs the reference's `generate` with our `SamplerConfig` and reports
    the per-row statistics that `sampler.generate` reports; `ours_stats` / `reference_stats`
    collect them over seeds;
  * `compare_means` is the two-sided Welch t-test used to call the statistics equal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma import generation_diffusion_gemma as ref_generation

from diffgemma.io import hf_weights
from diffgemma.model import transformer
from diffgemma.model.config import ModelConfig
from diffgemma.sampling import sampler

# Per-row statistics compared between the implementations.
STATS = ("steps_per_canvas", "tokens_per_forward")
# The smallest vision tower the config accepts; text-only use never runs it.
TINY_VISION = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                   num_key_value_heads=1, head_dim=16, position_embedding_size=16)
# Spread of the perturbed norm weights and scales around 1, and range of the layer scalars.
NORM_SPREAD = 0.3
LAYER_SCALAR_MIN, LAYER_SCALAR_RANGE = 0.5, 1.0


def reference_model(seed: int, canvas_length: int, weight_std: float, attn_implementation: str,
                    **text_config):
  """A random float32 reference model: linear and embedding weights ~ N(0, weight_std), norm
  weights and router scales ~ 1 + N(0, 0.3), layer scalars ~ U(0.5, 1.5) (equal in the encoder
  and decoder copies, as in a real checkpoint)."""
  torch.manual_seed(seed)
  config = DiffusionGemmaConfig(text_config=text_config, vision_config=TINY_VISION,
                                canvas_length=canvas_length)
  config._attn_implementation = attn_implementation
  ref = DiffusionGemmaForBlockDiffusion(config).eval().float()
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith(("norm.weight", ".scale", "per_expert_scale")):
        p.copy_(1.0 + NORM_SPREAD * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(weight_std * torch.randn(p.shape, generator=gen))
    buffers = dict(ref.named_buffers())
    for name, b in buffers.items():
      if name.endswith("layer_scalar") and name.startswith("model.encoder."):
        b.copy_(LAYER_SCALAR_MIN + LAYER_SCALAR_RANGE * torch.rand(b.shape, generator=gen))
        buffers["model.decoder.layers." + name.split("layers.")[1]].copy_(b)
  return ref


def bias_to_copy_(ref, branch_scale: float, token_norm_spread: float, seed: int) -> None:
  """Reshape the weights (in place) so that canvases stop after a varying number of steps.

  Random weights give near-uniform logits, so no canvas ever becomes confident. Two changes:
    * the post-attention and post-feed-forward norm weights and the self-conditioning output
      are scaled by `branch_scale`: each layer only perturbs the residual stream, and the
      decoder mostly predicts the token it is given (its logit is |embedding|^2-sized);
    * each token's embedding row is scaled by exp(token_norm_spread * N(0, 1)): "strong"
      tokens are predicted back confidently and accepted, "weak" ones stay uncertain and are
      renoised until a strong token lands there.
  A canvas stops once every position holds a strong token, so steps per canvas vary by row.
  The parameters are tied, so encoder, decoder and LM head all change.
  """
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                        "self_conditioning.down_proj.weight")):
        p.mul_(branch_scale)
    table = ref.get_input_embeddings().weight
    table.mul_(torch.exp(token_norm_spread * torch.randn(table.shape[0], 1, generator=gen)))


def state_dict_numpy(ref) -> dict[str, np.ndarray]:
  return {k: v.detach().cpu().numpy() for k, v in ref.state_dict().items()}


def load_ours(ref, **overrides):
  """(our ModelConfig, our params on device) holding the reference's weights."""
  cfg = hf_weights.config_from_hf(ref.config.to_dict(), **overrides)
  params = hf_weights.params_from_hf(state_dict_numpy(ref), cfg, transformer.abstract_params(cfg))
  return cfg, jax.tree_util.tree_map(jnp.asarray, params)


def reference_generation_config(sampler_cfg: sampler.SamplerConfig, model_cfg: ModelConfig):
  """The reference's generation config holding our sampler settings."""
  return ref_generation.DiffusionGemmaGenerationConfig(
      max_new_tokens=sampler_cfg.max_new_tokens,
      max_denoising_steps=sampler_cfg.max_denoising_steps,
      sampler_config=ref_generation.EntropyBoundSamplerConfig(
          entropy_bound=float(sampler_cfg.entropy_bound)),
      t_min=float(sampler_cfg.t_min), t_max=float(sampler_cfg.t_max),
      stability_threshold=sampler_cfg.stability_threshold,
      confidence_threshold=float(sampler_cfg.confidence_threshold),
      eos_token_id=model_cfg.eos_token_id, pad_token_id=model_cfg.pad_token_id)


@dataclasses.dataclass
class _PassCounter:
  """Wraps the reference's `_compute_tokens_per_forward` to keep the per-row decoder pass counts
  it is given (`generate` returns only their ratio to the token counts)."""

  wrapped: object
  passes_B: torch.Tensor | None = None

  def __call__(self, input_ids, decoder_forward_passes, initial_len, pad_token_id):
    self.passes_B = decoder_forward_passes.clone()
    return self.wrapped(input_ids, decoder_forward_passes, initial_len, pad_token_id)


def reference_generate(ref, prompt_BxP, sampler_cfg: sampler.SamplerConfig,
                       model_cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
  """The reference's `generate` (its default path: DynamicCache, eager PyTorch) on an unpadded
  prompt, with torch's global RNG seeded by `seed`.

  Returns a dict of per-row numpy arrays named as `sampler.GenerateOutput`'s fields: tokens
  [B, K*C] (pad-filled after an early stop of the whole batch), num_tokens, decoder_passes,
  num_canvases, steps_per_canvas, tokens_per_forward (the reference's own).
  """
  prompt = torch.as_tensor(np.asarray(prompt_BxP), dtype=torch.long)
  c, k_max = model_cfg.canvas_length, sampler.num_canvases(model_cfg, sampler_cfg)
  counter = _PassCounter(ref._compute_tokens_per_forward)
  ref._compute_tokens_per_forward = counter  # instance attribute: shadows the staticmethod
  try:
    torch.manual_seed(seed)
    out = ref.generate(prompt, generation_config=reference_generation_config(sampler_cfg,
                                                                             model_cfg))
  finally:
    del ref._compute_tokens_per_forward
  generated = out.sequences[:, prompt.shape[1]:].numpy()
  tokens = np.full((prompt.shape[0], k_max * c), model_cfg.pad_token_id, generated.dtype)
  tokens[:, :generated.shape[1]] = generated
  # A row denoises canvases up to the one holding its first EOS (or all K).
  is_eos = tokens == model_cfg.eos_token_id
  canvases = np.where(is_eos.any(-1), is_eos.argmax(-1) // c + 1, k_max)
  passes = counter.passes_B.numpy()
  return {"tokens": tokens, "num_tokens": (tokens != model_cfg.pad_token_id).sum(-1),
          "decoder_passes": passes, "num_canvases": canvases,
          "steps_per_canvas": passes / canvases,
          "tokens_per_forward": out.tokens_per_forward.numpy()}


def ours_stats(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig, prompt_BxP,
               seeds, compiler_options=None) -> dict[str, np.ndarray]:
  """Per-row STATS of our sampler, one run per seed over the same rows: {stat: [S * B]}.

  `compiler_options` go to XLA (tests pass fast-compile options)."""
  valid = np.ones(np.shape(prompt_BxP), bool)
  args = (params, model_cfg, sampler_cfg, prompt_BxP, valid, jax.random.PRNGKey(0))
  generate_fn = jax.jit(sampler.generate, static_argnums=(1, 2)).lower(*args).compile(
      compiler_options)
  runs = [jax.device_get(generate_fn(params, prompt_BxP, valid, jax.random.PRNGKey(seed)))
          for seed in seeds]
  return _concat_stats([run.to_dict() for run in runs])


def reference_stats(ref, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig, prompt_BxP,
                    seeds) -> dict[str, np.ndarray]:
  """Per-row STATS of the reference's `generate`, one run per seed: {stat: [S * B]}."""
  return _concat_stats([reference_generate(ref, prompt_BxP, sampler_cfg, model_cfg, seed)
                        for seed in seeds])


def _concat_stats(runs) -> dict[str, np.ndarray]:
  return {s: np.concatenate([np.asarray(r[s], np.float64) for r in runs]) for s in STATS}


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Welch's two-sided t-test of equal means, with the CI of the difference (ours - theirs)."""

  stat: str
  mean_ours: float
  mean_theirs: float
  ci_low: float
  ci_high: float
  p_value: float
  alpha: float

  @property
  def agree(self) -> bool:
    return self.p_value >= self.alpha

  def __str__(self):
    return (f"{self.stat:18s}: ours {self.mean_ours:7.3f}  theirs {self.mean_theirs:7.3f}  "
            f"diff 95% CI [{self.ci_low:+.3f}, {self.ci_high:+.3f}]  Welch p = {self.p_value:.3f}"
            f"  {'PASS' if self.agree else 'FAIL'} (alpha {self.alpha})")


def compare_means(ours, theirs, stat: str, alpha: float, confidence: float = 0.95) -> Comparison:
  """Welch's t-test on per-row values (rows are independent: each has its own noise)."""
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
  test = scipy.stats.ttest_ind(ours, theirs, equal_var=False)
  ci = test.confidence_interval(confidence)
  # Identical constant samples (e.g. every canvas at the step limit) have no variance: equal.
  p_value = 1.0 if np.isnan(test.pvalue) else float(test.pvalue)
  return Comparison(stat, float(ours.mean()), float(theirs.mean()), float(ci.low),
                    float(ci.high), p_value, alpha)
