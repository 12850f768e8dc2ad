"""Ours against the transformers reference on the same weights, measured in one process.

  python benchmarks/vs_transformers.py [--batch_sizes=1,8] [--repeats=5] [--hidden_size=128]

Builds a random tiny DiffusionGemma in transformers (sizes are flags), loads the same weights
into ours with `hf_weights`, and prints the median time (or rate) of each implementation and
the speedup (theirs / ours time, i.e. ours/theirs throughput) of
  (a) one decoder step: a canvas with self-conditioning against a cached prompt (ours: jitted
      `transformer.decode`; theirs: the forward call of the reference's `_denoising_step`, with the
      attention masks prepared once per canvas as its `generate` does);
  (b) end-to-end generation, tokens/s, with the report's sampler settings (`SamplerConfig`
      defaults; theirs through `generate(generation_config=...)`) at each batch size on the same
      prompts (batch 1 runs them one at a time);
  (c) one SFT training step, forward + backward (ours: `jax.value_and_grad(losses.sft_loss)`
      jitted; theirs: the same objective written with the reference's modules, which have no
      training loss of their own: encoder CE over the clean sequence, a corrupted canvas per
      example decoded against the encoder's cache, self-conditioning from a gradient-free first
      pass for half the batch; checked first against ours on identical random draws);
  (d) the sampler statistics: steps per canvas and tokens per forward pass (TPF) over
      `--stats_rows` prompts and `--stats_seeds` seeds, compared by Welch's t-test (PASS when
      p >= --alpha). tests/test_sampler.py already checks the acceptance mask, temperature
      schedule, stopping rule and EOS handling exactly on identical logits; (d) checks that the
      whole loop, with its own random numbers, behaves the same.

Random weights never become confident, so every canvas would run all 48 steps; the weights are
reshaped (`reference_sampling.bias_to_copy_`: `--branch_scale`, `--token_norm_spread`) so that
canvases stop after a number of steps that varies by row, as a trained model's do. The reference
runs its default path: DynamicCache, eager PyTorch with `--reference_attention`, on
`--torch_threads` threads (its `cache_implementation="static"` path, which torch.compiles,
is not measured). Set --branch_scale=1 --token_norm_spread=0 for plain random weights.
Compilation and warm-up happen before the timed calls; each implementation's calls run as one
block after a pause (see `timings`).

Roofline: (a) and (c) also print each side's achieved GFLOP/s, counting the useful FLOPs of the
work (the reference's matmuls and attention under torch's FlopCounterMode: its MoE multiplies
only the rows routed to each expert, so padding or masking on either side is not counted),
against the machine's measured matmul peak (the faster of jax and torch on a --peak_size cube).
When both sides run near that peak, no implementation of the same work can be much faster.
When both run far below it, (a) also prints the operations each side runs per step (our
compiled program's XLA thunks; the aten calls torch dispatches) and the mean time per operation:
a small model's step time is then about operations x cost per operation.
"""

import copy
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils.flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
import transformers
from absl import flags
from transformers.cache_utils import DynamicCache

from diffgemma import cli
from diffgemma.training import diffusion, losses
from diffgemma.model import transformer
from diffgemma.sampling import sampler
from diffgemma.tasks import Layout

# The transformers reference's sampler, shared with the tests (not part of the package).
rs = cli.load_module(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "tests", "reference_sampling.py"))

# Model sizes (transformers' names).
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "Vocabulary size.")
_HIDDEN = flags.DEFINE_integer("hidden_size", 128, "Hidden size.")
_INTERMEDIATE = flags.DEFINE_integer("intermediate_size", 256, "Dense MLP intermediate size.")
_LAYERS = flags.DEFINE_integer("num_layers", 6, "Layers (5 sliding : 1 full, last full).")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "KV heads of sliding layers.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 32, "Head dim of sliding layers.")
_GLOBAL_HEAD_DIM = flags.DEFINE_integer("global_head_dim", 64, "Head dim of full layers.")
_GLOBAL_KV_HEADS = flags.DEFINE_integer("num_global_kv_heads", 1, "KV heads of full layers.")
_WINDOW = flags.DEFINE_integer("sliding_window", 128, "Sliding window.")
_EXPERTS = flags.DEFINE_integer("num_experts", 8, "Experts.")
_TOP_K = flags.DEFINE_integer("top_k_experts", 2, "Experts per token.")
_MOE_INTERMEDIATE = flags.DEFINE_integer("moe_intermediate_size", 64, "Expert MLP size.")
_CANVAS = flags.DEFINE_integer("canvas_length", 32, "Canvas length C.")
_SEED = flags.DEFINE_integer("seed", 0, "Weight seed.")
_WEIGHT_STD = flags.DEFINE_float("weight_std", 0.2, "Std of the random linear weights.")
_BRANCH_SCALE = flags.DEFINE_float("branch_scale", 0.3, "See reference_sampling.bias_to_copy_.")
_TOKEN_NORM_SPREAD = flags.DEFINE_float("token_norm_spread", 0.5,
                                        "See reference_sampling.bias_to_copy_.")
# Our implementation.
_MOE_IMPL = flags.DEFINE_enum("moe_impl", "tiled", ["tiled", "ragged_dot"], "Our MoE kernel.")
_MOE_TILE = flags.DEFINE_integer("moe_tile_size", 32, "Rows per tile of our tiled MoE.")
_FUSED_STEP = flags.DEFINE_bool("fused_step", False, "Our sampler's fused step (SamplerConfig).")
# The reference.
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", os.cpu_count(), "torch intra-op threads.")
_REF_ATTENTION = flags.DEFINE_enum("reference_attention", "sdpa", ["sdpa", "eager"],
                                   "The reference's attention implementation (sdpa: its default).")
# Workloads.
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens (a multiple of C: "
                                "several canvases).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes of (a) and (b).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats of (b) (median).")
_STEP_REPEATS = flags.DEFINE_integer("step_repeats", 30, "Timed decoder steps in (a) (median).")
_TRAIN_REPEATS = flags.DEFINE_integer("train_repeats", 10, "Timed steps in (c) (median).")
_TRAIN_BATCH = flags.DEFINE_integer("train_batch", 8, "Sequences per training step.")
_TRAIN_CANVASES = flags.DEFINE_integer("train_canvases", 2, "Response canvases per sequence.")
_STATS_ROWS = flags.DEFINE_integer("stats_rows", 64, "Prompts (rows) of the statistics check.")
_STATS_SEEDS = flags.DEFINE_integer("stats_seeds", 3, "Seeds of the statistics check.")
_SETTLE_S = flags.DEFINE_float("settle_s", 2.0, "Pause before each timed block (seconds).")
_SAMPLER_TARGET = flags.DEFINE_float("sampler_target", 5.0, "Sampler speedup goal (b).")
_TRAIN_TARGET = flags.DEFINE_float("train_target", 2.0, "Training-step speedup goal (c).")
_ALPHA = flags.DEFINE_float("alpha", 0.01, "Significance level of the statistics check.")
_LOSS_TOL = flags.DEFINE_float("loss_tol", 1e-3, "Largest |loss diff| and relative gradient "
                               "diff of (c)'s faithfulness check.")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 1024, "Side of the float32 matmul of the peak.")


def text_config() -> dict:
  return dict(
      vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value,
      intermediate_size=_INTERMEDIATE.value, num_hidden_layers=_LAYERS.value,
      num_attention_heads=_HEADS.value, num_key_value_heads=_KV_HEADS.value,
      head_dim=_HEAD_DIM.value, global_head_dim=_GLOBAL_HEAD_DIM.value,
      num_global_key_value_heads=_GLOBAL_KV_HEADS.value, sliding_window=_WINDOW.value,
      num_experts=_EXPERTS.value, top_k_experts=_TOP_K.value,
      moe_intermediate_size=_MOE_INTERMEDIATE.value,
      max_position_embeddings=2 * (_PROMPT_LEN.value + _MAX_NEW.value))


def timings(fns, repeats: int):
  """Calls fns[name](i) for i in range(repeats), one implementation after the other, each after
  a pause of --settle_s. Every call must block until its result is ready.
  Returns {name: ([seconds per call], [results])}.

  Not interleaved call by call: on 2 cores, torch's OpenMP threads and XLA's thread pool keep
  spinning for a while after their work, and alternating the two slowed torch by up to 60x.
  """
  out = {}
  for name, fn in fns.items():
    time.sleep(_SETTLE_S.value)
    seconds, results = [], []
    for i in range(repeats):
      start = time.perf_counter()
      results.append(fn(i))
      seconds.append(time.perf_counter() - start)
    out[name] = (seconds, results)
  return out


def reference_flops(fn) -> int:
  """FLOPs of the reference's aten calls made by fn() (matmuls, attention; forward and
  backward)."""
  with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
    fn()
  return counter.get_total_flops()


def peak_gflops(repeats: int = 10) -> dict:
  """Median GFLOP/s of an n x n x n float32 matmul in each framework: the machine's practical
  peak for these implementations."""
  n = _PEAK_SIZE.value
  a = np.random.default_rng(0).normal(size=(n, n)).astype(np.float32)
  ja, ta = jnp.asarray(a), torch.as_tensor(a)
  matmul = jax.jit(lambda x: x @ x)
  matmul(ja).block_until_ready()
  with torch.no_grad():
    ta @ ta
    measured = timings({"jax": lambda _: matmul(ja).block_until_ready(),
                        "torch": lambda _: ta @ ta}, repeats)
  return {name: 2 * n ** 3 / np.median(seconds) / 1e9
          for name, (seconds, _) in measured.items()}


# HLO instructions that run no code of their own in XLA:CPU's thunk runtime.
_FREE_HLO_OPS = frozenset({"parameter", "bitcast", "get-tuple-element", "constant", "tuple"})


def xla_op_count(compiled) -> dict:
  """Operations a compiled program runs per call: the instructions of its entry computation
  that execute (fusions, copies, custom calls, ...), by opcode. A `while` counts once, so a
  program with loops (the tiled MoE at larger batches) is undercounted; the report says so."""
  text = compiled.as_text()
  entry = text[text.index("\nENTRY"):].split("\n}")[0]
  counts = {}
  for line in entry.split("\n")[1:]:
    rhs = line.partition("=")[2]
    opcode = re.search(r"([a-z][\w-]*)\(", rhs)
    if opcode and opcode.group(1) not in _FREE_HLO_OPS:
      counts[opcode.group(1)] = counts.get(opcode.group(1), 0) + 1
  return counts


class _AtenCounter(TorchDispatchMode):
  """Counts the aten operations torch dispatches (each one a kernel call in eager mode)."""

  def __init__(self):
    super().__init__()
    self.count = 0

  def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    self.count += 1
    return func(*args, **(kwargs or {}))


def aten_op_count(fn) -> int:
  with _AtenCounter() as counter:
    fn()
  return counter.count


def report_op_costs(ours_ops: dict, theirs_ops: int, ours_ms: float, theirs_ms: float) -> None:
  """Per-call operations and the mean time per operation of each side: when both are small
  programs of many small operations, time ~ operations x cost per operation."""
  n_ours = sum(ours_ops.values())
  loops = " (has while loops: counted once)" if "while" in ours_ops else ""
  print(f"    operations per call: ours {n_ours} XLA thunks{loops}, {1e3 * ours_ms / n_ours:.1f} "
        f"us each; theirs {theirs_ops} aten ops, {1e3 * theirs_ms / theirs_ops:.1f} us each",
        flush=True)


def report_roofline(flops: int, ours_s: float, theirs_s: float, peak: float) -> None:
  ours, theirs = flops / ours_s / 1e9, flops / theirs_s / 1e9
  print(f"    {flops / 1e6:.1f} MFLOP of useful work: ours {ours:.1f} GFLOP/s ({ours / peak:.0%} "
        f"of peak), theirs {theirs:.1f} GFLOP/s ({theirs / peak:.0%})", flush=True)


def report(name: str, ours: float, theirs: float, unit: str, higher_is_better: bool) -> float:
  """Prints one comparison; returns the speedup of ours."""
  speedup = ours / theirs if higher_is_better else theirs / ours
  print(f"  {name:24s} ours {ours:10.2f} {unit:9s} theirs {theirs:10.2f} {unit:9s} "
        f"speedup {speedup:6.2f}x", flush=True)
  return speedup


# ----------------------------------------------------------------------------- (a) decoder step


def bench_decoder_step(ref, params, cfg, sampler_cfg, batch: int, prompt_BxP):
  """Milliseconds of one decoder forward over a canvas with self-conditioning logits."""
  p, c, v = prompt_BxP.shape[1], cfg.canvas_length, cfg.vocab_size
  rng = np.random.default_rng(batch)
  canvas_BxC = rng.integers(0, v, (batch, c))
  sc_BxCxV = rng.normal(0.0, 3.0, (batch, c, v)).astype(np.float32)

  # Ours: the cache `sampler.generate` allocates (prompt + K canvases), holding the prompt.
  cache = transformer.init_cache(cfg, batch, p + sampler.num_canvases(cfg, sampler_cfg) * c)
  _, cache = jax.jit(lambda prm, t, ch: transformer.encode(prm, cfg, t, ch))(params, prompt_BxP,
                                                                             cache)
  ours_args = (params, jnp.asarray(canvas_BxC, jnp.int32), cache, jnp.asarray(sc_BxCxV))
  # One executable serves the logits check, the operation count and the timing.
  decode = jax.jit(lambda prm, x, ch, sc: transformer.decode(prm, cfg, x, ch, None, sc,
                                                           jnp.ones((x.shape[0],), bool))
                   ).lower(*ours_args).compile()
  ours_logits = np.asarray(decode(*ours_args))

  # Theirs: encode the prompt, prepare the masks once, then the `_denoising_step` call.
  with torch.no_grad():
    ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    ref.model.encoder(input_ids=torch.as_tensor(prompt_BxP, dtype=torch.long), cache=ref_cache)
    canvas = torch.as_tensor(canvas_BxC, dtype=torch.long)
    masks = ref.model.decoder.create_diffusion_decoder_attention_mask(
        config=ref.config, inputs_embeds=canvas.unsqueeze(-1), cache=ref_cache,
        decoder_attention_mask=torch.ones((batch, p + c), dtype=torch.bool))
    ref_args = dict(decoder_input_ids=canvas, self_conditioning_logits=torch.as_tensor(sc_BxCxV),
                    decoder_attention_mask=masks, cache=ref_cache,
                    decoder_position_ids=torch.arange(p, p + c, dtype=torch.int32)[None])
    theirs_logits = ref(**ref_args).logits.numpy()
    flops = reference_flops(lambda: ref(**ref_args))
    theirs_ops = aten_op_count(lambda: ref(**ref_args))
  ours_ops = xla_op_count(decode)
  max_diff = float(np.abs(ours_logits - theirs_logits).max())

  with torch.no_grad():
    measured = timings({"ours": lambda _: decode(*ours_args).block_until_ready(),
                        "theirs": lambda _: ref(**ref_args)}, _STEP_REPEATS.value)
  ours_ms, theirs_ms = (1e3 * np.median(measured[name][0]) for name in ("ours", "theirs"))
  return ours_ms, theirs_ms, max_diff, flops, ours_ops, theirs_ops


# ----------------------------------------------------------------------------- (b) generation


def bench_generate(ref, params, cfg, sampler_cfg, batch: int, prompts_NxP):
  """tokens/s of both samplers on the same prompts, `batch` rows per call; median of repeats
  (repeat r uses seed r on both sides). Also returns mean steps per canvas of each."""
  valid = np.ones((batch, prompts_NxP.shape[1]), bool)
  chunks = [prompts_NxP[i:i + batch] for i in range(0, len(prompts_NxP), batch)]
  generate_fn = sampler.make_generate_fn(cfg, sampler_cfg)

  def ours(seed):
    outs = [jax.device_get(generate_fn(params, x, valid, jax.random.PRNGKey(seed)))
            for x in chunks]
    return [(o.num_tokens, o.steps_per_canvas) for o in outs]

  def theirs(seed):
    outs = [rs.reference_generate(ref, x, sampler_cfg, cfg, seed) for x in chunks]
    return [(o["num_tokens"], o["steps_per_canvas"]) for o in outs]

  ours(_REPEATS.value)  # compile; both warm up on a seed that is not timed
  theirs(_REPEATS.value)
  measured = timings({"ours": ours, "theirs": theirs}, _REPEATS.value)
  results = {}
  for name, (seconds, runs) in measured.items():
    # tokens/s of each repeat (its tokens over its time), then the median over repeats.
    rates = [sum(float(np.sum(n)) for n, _ in outs) / t for outs, t in zip(runs, seconds)]
    steps = np.mean([np.mean(np.concatenate([s for _, s in outs])) for outs in runs])
    results[name] = (float(np.median(rates)), float(steps))
  return results


# ----------------------------------------------------------------------------- (c) training


def training_batch(cfg, batch: int, prompt_len: int, canvases: int, rng):
  """Random sequences: prompt + `canvases` supervised canvases, all tokens valid."""
  seq_len = prompt_len + canvases * cfg.canvas_length
  tokens = rng.integers(3, cfg.vocab_size, (batch, seq_len)).astype(np.int32)
  loss_mask = np.broadcast_to(np.arange(seq_len) >= prompt_len, (batch, seq_len)).copy()
  return {"tokens": tokens, "valid": np.ones((batch, seq_len), bool), "loss_mask": loss_mask}


def jax_draws(cfg, loss_cfg, batch, rng):
  """The canvas choice and corrupted canvas that `losses.sft_loss` draws from `rng`."""
  canvas_rng, t_rng, noise_rng = jax.random.split(rng, 3)
  b, seq_len = batch["tokens"].shape
  c, p = cfg.canvas_length, _PROMPT_LEN.value
  k = (seq_len - p) // c
  has_target_BxK = batch["loss_mask"][:, p:].reshape(b, k, c).any(-1)
  k_B = jax.random.categorical(canvas_rng, jnp.where(has_target_BxK, 0.0, -jnp.inf))
  index_BxC = (p + k_B * c)[:, None] + jnp.arange(c)
  clean_BxC = jnp.take_along_axis(jnp.asarray(batch["tokens"]), index_BxC, axis=1)
  target_BxC = jnp.take_along_axis(jnp.asarray(batch["loss_mask"]), index_BxC, axis=1)
  t_B = diffusion.sample_noise_level(t_rng, b, loss_cfg.t_eps)
  noisy_BxC = diffusion.corrupt(noise_rng, clean_BxC, t_B, cfg.vocab_size,
                                loss_cfg.noise_schedule, target_BxC)
  # Copies: arrays from JAX are read-only, which torch warns about.
  return (torch.tensor(np.array(k_B)), torch.tensor(np.array(noisy_BxC), dtype=torch.long))


def torch_draws(cfg, loss_cfg, tokens, loss_mask, gen):
  """The same draws with torch's RNG: a canvas with targets per example, t ~ U(eps, 1), each
  target token kept with probability 1 - t (linear schedule), else uniform noise."""
  b, seq_len = tokens.shape
  c, p = cfg.canvas_length, _PROMPT_LEN.value
  has_target_BxK = loss_mask[:, p:].reshape(b, -1, c).any(-1)
  k_B = torch.multinomial(has_target_BxK.float(), 1, generator=gen)[:, 0]
  index_BxC = (p + k_B * c)[:, None] + torch.arange(c)
  t_B = loss_cfg.t_eps + (1.0 - loss_cfg.t_eps) * torch.rand(b, generator=gen)
  keep_BxC = torch.rand(b, c, generator=gen) < (1.0 - t_B)[:, None]
  keep_BxC |= ~loss_mask.gather(1, index_BxC)
  noise_BxC = torch.randint(0, cfg.vocab_size, (b, c), generator=gen)
  return k_B, torch.where(keep_BxC, tokens.gather(1, index_BxC), noise_BxC)


def _cache_rows(cache, rows):
  """A DynamicCache of the given batch rows (for the first self-conditioning pass)."""
  view = copy.copy(cache)
  view.layers = [copy.copy(layer) for layer in cache.layers]
  for layer in view.layers:
    layer.keys, layer.values = layer.keys[rows], layer.values[rows]
  return view


def masked_mean(x, mask):
  mask = mask.float()
  return (x * mask).sum() / mask.sum().clamp(min=1.0)


def reference_sft_loss(ref, cfg, loss_cfg, tokens, valid, loss_mask, k_B, noisy_BxC):
  """`losses.sft_loss` written with the reference's encoder, decoder and LM head."""
  b, seq_len = tokens.shape
  c, p = cfg.canvas_length, _PROMPT_LEN.value
  softcap = ref.config.get_text_config().final_logit_softcapping
  lm_logits = lambda h: softcap * torch.tanh(ref.lm_head(h).float() / softcap)
  ce = lambda logits, targets: torch.nn.functional.cross_entropy(
      logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)

  # One causal encoder pass over the clean sequence fills the cache the decoder reads.
  cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
  hidden = ref.model.encoder(input_ids=tokens, attention_mask=valid, cache=cache).last_hidden_state
  scope = loss_mask | ((torch.arange(seq_len)[None] < p)
                       & (loss_cfg.encoder_scope == "prompt_and_target"))
  targets_mask = valid[:, :-1] & valid[:, 1:] & scope[:, 1:]
  encoder_loss = masked_mean(ce(lm_logits(hidden[:, :-1]), tokens[:, 1:]), targets_mask)

  # The decoder sees the clean prefix before its canvas; positions continue after it.
  index_BxC = (p + k_B * c)[:, None] + torch.arange(c)
  prefix_BxL = valid & (torch.arange(seq_len)[None] < (p + k_B * c)[:, None])
  decoder_mask = torch.cat([prefix_BxL, torch.ones((b, c), dtype=torch.bool)], dim=1)
  # Ours self-conditions the first k of every g rows (losses.self_conditioning_rows).
  k, g = losses.self_conditioning_rows(b, loss_cfg.self_conditioning_prob)
  sc_mask_B = torch.arange(b) % g < k
  sc_logits = None
  if k:
    rows = torch.nonzero(sc_mask_B)[:, 0]
    with torch.no_grad():
      first = ref(cache=_cache_rows(cache, rows), decoder_input_ids=noisy_BxC[rows],
                  decoder_attention_mask=decoder_mask[rows],
                  decoder_position_ids=index_BxC[rows]).logits
    sc_logits = first.new_zeros((b,) + first.shape[1:])
    sc_logits[rows] = first
  logits = ref(cache=cache, decoder_input_ids=noisy_BxC, self_conditioning_logits=sc_logits,
               self_conditioning_mask=sc_mask_B, decoder_attention_mask=decoder_mask,
               decoder_position_ids=index_BxC).logits
  decoder_loss = masked_mean(ce(logits, tokens.gather(1, index_BxC)),
                             loss_mask.gather(1, index_BxC))
  return loss_cfg.encoder_weight * encoder_loss + loss_cfg.decoder_weight * decoder_loss


def bench_training(ref, params, cfg):
  """(ours s, theirs s, |loss diff|, max relative embedding-gradient diff, useful FLOPs of a
  step)."""
  loss_cfg = losses.LossConfig()
  layout = Layout(_PROMPT_LEN.value, _TRAIN_CANVASES.value, cfg.canvas_length)
  if loss_cfg.noise_schedule != "linear" or loss_cfg.decoder_weighting != "flat":
    raise ValueError("the reference objective here implements the linear schedule, flat CE")
  batch = training_batch(cfg, _TRAIN_BATCH.value, _PROMPT_LEN.value, _TRAIN_CANVASES.value,
                         np.random.default_rng(0))
  if batch["tokens"].shape[1] > cfg.sliding_window:
    # The reference's sliding-layer cache keeps the window of the whole sequence, not of the
    # prefix before each canvas, so the objectives agree only within one window.
    raise ValueError("train sequence longer than the sliding window")
  loss_and_grad = jax.jit(jax.value_and_grad(losses.sft_loss, has_aux=True),
                          static_argnums=(1, 2, 3))
  t_batch = {k: torch.as_tensor(v, dtype=torch.long if k == "tokens" else torch.bool)
             for k, v in batch.items()}

  def theirs_step(draws):
    ref.zero_grad(set_to_none=True)
    loss = reference_sft_loss(ref, cfg, loss_cfg, t_batch["tokens"], t_batch["valid"],
                              t_batch["loss_mask"], *draws)
    loss.backward()
    return loss.detach()

  # Faithfulness: identical draws give the same loss and gradients.
  rng = jax.random.PRNGKey(0)
  (ours_loss, _), grads = loss_and_grad(params, cfg, loss_cfg, layout, batch, rng)
  ref.train()
  theirs_loss = theirs_step(jax_draws(cfg, loss_cfg, batch, rng))
  flops = reference_flops(lambda: theirs_step(jax_draws(cfg, loss_cfg, batch, rng)))
  loss_diff = abs(float(ours_loss) - theirs_loss.item())
  ours_grad = np.asarray(grads["embedding"])
  theirs_grad = ref.get_input_embeddings().weight.grad.numpy()
  grad_diff = float(np.abs(ours_grad - theirs_grad).max() / np.abs(theirs_grad).max())

  keys = jax.random.split(jax.random.PRNGKey(1), _TRAIN_REPEATS.value)
  gen = torch.Generator().manual_seed(1)
  measured = timings({
      "ours": lambda i: jax.block_until_ready(loss_and_grad(params, cfg, loss_cfg, layout, batch,
                                                            keys[i])),
      "theirs": lambda _: theirs_step(torch_draws(cfg, loss_cfg, t_batch["tokens"],
                                                  t_batch["loss_mask"], gen))},
      _TRAIN_REPEATS.value)
  ours_s, theirs_s = (float(np.median(measured[name][0])) for name in ("ours", "theirs"))
  ref.eval()
  ref.zero_grad(set_to_none=True)
  return ours_s, theirs_s, loss_diff, grad_diff, flops


# ----------------------------------------------------------------------------- main


def main(argv):
  del argv
  torch.set_num_threads(_TORCH_THREADS.value)
  start = time.perf_counter()
  ref = rs.reference_model(_SEED.value, _CANVAS.value, _WEIGHT_STD.value, _REF_ATTENTION.value,
                           **text_config())
  rs.bias_to_copy_(ref, _BRANCH_SCALE.value, _TOKEN_NORM_SPREAD.value, seed=_SEED.value + 2)
  cfg, params = rs.load_ours(ref, moe_impl=_MOE_IMPL.value, moe_tile_size=_MOE_TILE.value)
  sampler_cfg = sampler.SamplerConfig(max_new_tokens=_MAX_NEW.value,
                                      fused_step=_FUSED_STEP.value)
  batch_sizes = [int(b) for b in _BATCH_SIZES.value]
  print(f"model: {transformer.count_params(params):,} parameters (vocab {cfg.vocab_size}, hidden "
        f"{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts top-"
        f"{cfg.top_k_experts}, canvas {cfg.canvas_length}); weights: std {_WEIGHT_STD.value}, "
        f"branch_scale {_BRANCH_SCALE.value}, token_norm_spread {_TOKEN_NORM_SPREAD.value}")
  print(f"ours: jax {jax.__version__} on {jax.devices()[0].platform}, moe_impl={cfg.moe_impl} "
        f"(tile {cfg.moe_tile_size}); theirs: transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, "
        f"attention={_REF_ATTENTION.value}, DynamicCache")
  print(f"sampler: {sampler_cfg}")
  prompts = np.random.default_rng(1).integers(3, cfg.vocab_size,
                                              (max(batch_sizes), _PROMPT_LEN.value), np.int32)

  peaks = peak_gflops()
  peak = max(peaks.values())
  print(f"peak: {_PEAK_SIZE.value}^3 float32 matmul, jax {peaks['jax']:.1f} GFLOP/s, torch "
        f"{peaks['torch']:.1f} GFLOP/s")
  print("(a) decoder step (one canvas, self-conditioning, cached prompt):")
  for b in batch_sizes:
    ours_ms, theirs_ms, diff, flops, ours_ops, theirs_ops = bench_decoder_step(
        ref, params, cfg, sampler_cfg, b, prompts[:b])
    report(f"batch {b} (|dlogits| {diff:.0e})", ours_ms, theirs_ms, "ms", False)
    report_roofline(flops, ours_ms / 1e3, theirs_ms / 1e3, peak)
    report_op_costs(ours_ops, theirs_ops, ours_ms, theirs_ms)

  print(f"(b) generate, {_MAX_NEW.value} new tokens after {_PROMPT_LEN.value}, the same "
        f"{len(prompts)} prompts at each batch size; median of {_REPEATS.value}:")
  goals = []
  for b in batch_sizes:
    res = bench_generate(ref, params, cfg, sampler_cfg, b, prompts)
    speedup = report(f"batch {b} (steps/canvas {res['ours'][1]:.1f}|{res['theirs'][1]:.1f})",
                     res["ours"][0], res["theirs"][0], "tokens/s", True)
    goals.append((f"sampler batch {b}", speedup, _SAMPLER_TARGET.value))

  print(f"(c) SFT training step, forward + backward, batch {_TRAIN_BATCH.value} x "
        f"({_PROMPT_LEN.value} + {_TRAIN_CANVASES.value} x {cfg.canvas_length}) tokens:")
  ours_s, theirs_s, loss_diff, grad_diff, flops = bench_training(ref, params, cfg)
  print(f"  same draws: |loss diff| {loss_diff:.1e}, embedding grad max rel. diff {grad_diff:.1e}")
  if loss_diff > _LOSS_TOL.value or grad_diff > _LOSS_TOL.value:
    raise SystemExit(f"the two training objectives disagree beyond {_LOSS_TOL.value:g} on the "
                     "same draws: reference_sft_loss no longer matches losses.sft_loss")
  goals.append(("training", report("step", 1e3 * ours_s, 1e3 * theirs_s, "ms", False),
                _TRAIN_TARGET.value))
  report_roofline(flops, ours_s, theirs_s, peak)

  rows, seeds = _STATS_ROWS.value, range(_STATS_SEEDS.value)
  print(f"(d) sampler statistics, {rows} prompts x {len(seeds)} seeds per implementation, "
        f"Welch's two-sided t-test on per-row values:")
  stats_prompts = np.random.default_rng(2).integers(3, cfg.vocab_size, (rows, _PROMPT_LEN.value),
                                                    np.int32)
  ours = rs.ours_stats(params, cfg, sampler_cfg, stats_prompts, seeds)
  theirs = rs.reference_stats(ref, cfg, sampler_cfg, stats_prompts, seeds)
  results = [rs.compare_means(ours[s], theirs[s], s, _ALPHA.value) for s in rs.STATS]
  for result in results:
    print(f"  {result}")
  spread = theirs["steps_per_canvas"]
  print(f"  (steps per canvas: std {spread.std():.1f}, range {spread.min():.1f}-"
        f"{spread.max():.1f} of {sampler_cfg.max_denoising_steps})")
  print("goals: " + ", ".join(f"{name} {got:.2f}x {'>=' if got >= goal else '<'} {goal:g}x"
                              for name, got, goal in goals))
  print(f"statistics: {'PASS' if all(r.agree for r in results) else 'FAIL'}; "
        f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  cli.run(main)
