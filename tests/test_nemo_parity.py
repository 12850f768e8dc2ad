"""Our SFT objective against NeMo AutoModel's DiffusionGemma recipe (nemo-automodel 0.7.0).

One tiny random DiffusionGemma (float32) is built here, exported with our converter
(`hf_weights.hf_tensor_specs`) and loaded into NeMo's `DiffusionGemmaForBlockDiffusion` through
its own state-dict adapter. One chat batch goes to both sides: our chat task lays it out (a
system turn, a reply of 3 canvases, a two-turn conversation, byte tokenizer); NeMo's
`DLLMCollator` (response-window mode) collates the same prompt and reply ids. NeMo's recipe
(`DiffusionGemmaSFTRecipe`, driven through its own methods: corruption, response window,
denominators, forward/backward) draws the corruption and picks one canvas per example; both
are fed to our `losses.sft_loss` as `Draws`, and NeMo's per-example self-conditioning coins are
set to our rows (`losses.self_conditioning_rows`), so both sides compute the same quantities:

  * encoder next-token logits over every real token;
  * decoder logits of every canvas (NeMo: all canvases in one pass under its block-causal
    mask; ours: one decoder call per canvas over the encoder cache), with and without
    self-conditioning;
  * each loss term and the total (our encoder_scope "prompt_and_target" is NeMo's AR scope;
    our default "target" scope is checked against NeMo's `encoder_ar_loss` on that scope);
  * the gradient of the total with respect to every parameter (the router unfrozen on both
    sides; NeMo folds the per-expert scale into the experts' down projection, so those two
    gradients are compared through the chain rule);
  * our canvas_selection "all" against NeMo's all-canvas forward scored on every canvas, and
    normalization "example" against NeMo's per-token losses averaged per example.

Tolerances: float32 on both sides, different layouts (our prompts are left-padded, NeMo's
right-padded: RoPE positions differ by the padding, which is exact only in real arithmetic) and
different summation orders. Measured when this file was written: logits within 1.7e-5, losses
within 1e-7 relative, gradients within 1.8e-5 of each tensor's largest entry (docs/design.md);
the tolerances below leave a margin of about 6x to 100x. A real mismatch (a mask off by one
block, a missed scale) is > 1e-2.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaConfig

from nemo_automodel.components.datasets.dllm.collate import DLLMCollator
from nemo_automodel.components.loss.dllm_loss import (BlockDiffusionCrossEntropyLoss,
                                                       encoder_ar_loss)
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.diffusion_gemma.model import (
    DiffusionGemmaForBlockDiffusion)
from nemo_automodel.recipes.dllm import train_ft
from nemo_automodel.recipes.dllm.strategy import BlockDiffusionStrategy

from diffgemma.io import hf_weights
from diffgemma.model import transformer
from diffgemma.tasks import chat
from diffgemma.training import losses, run_config
from tests.helpers import chat as chat_record
from tests.helpers import make_config, write_jsonl

LOGIT_TOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_TOL = 2e-4  # relative to each tensor's largest gradient entry
C = 8  # canvas length
PROMPT_LEN, NUM_CANVASES = 48, 4
SC_PROB = 0.5
CONVERSATIONS = [
    chat_record("hi", "ok", system="be brief"),  # a system turn
    chat_record("count to ten", "1 2 3 4 5 6 7 8 9 10"),  # 21 ids: 3 canvases
    chat_record("sort: c a b", "a b c"),
    chat_record("why?", "because"),
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "first"},
                  {"role": "user", "content": "more"},
                  {"role": "assistant", "content": "second reply"}]},  # two examples
]


def random_params(cfg):
  """Random weights of our layout (numpy: no compile), every norm, router scale and per-expert
  scale away from 1 and the layer scalars in [0.5, 1.5), so both sides read every tensor."""
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    if "norm" in name or "scale" in name:
      x = 1.0 + 0.3 * rng.standard_normal(leaf.shape)
    elif "layer_scalar" in name:
      x = 0.5 + rng.random(leaf.shape)
    else:
      x = 0.15 * rng.standard_normal(leaf.shape)
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, transformer.abstract_params(cfg))


def bare_recipe(model, cfg, tok, sc_rows_B):
  """NeMo's DiffusionGemmaSFTRecipe without its setup (no distributed init, no data loaders):
  the attributes its objective methods read, as its setup would set them for this model."""
  recipe = object.__new__(train_ft.DiffusionGemmaSFTRecipe)
  strategy = BlockDiffusionStrategy()
  recipe.dllm_strategy = strategy
  recipe.dllm_loss_fn = strategy.create_loss_fn({"vocab_size": cfg.vocab_size})
  recipe.step_scheduler = types.SimpleNamespace(step=7, grad_acc_steps=1)
  recipe._self_cond_base_seed = 1234
  recipe.mask_token_id, recipe.dllm_eps, recipe.dllm_half_life_ratio = 0, 1e-3, 0.25
  recipe.dllm_block_size = recipe.canvas_length = C
  recipe.block_diffusion_sliding_window = cfg.sliding_window
  recipe.self_conditioning_p, recipe._encoder_loss_weight = SC_PROB, 1.0
  recipe._pad_token_id = tok.pad_id
  recipe.device_mesh, recipe.te_fp8 = None, None
  recipe.dist_env = types.SimpleNamespace(device=torch.device("cpu"))
  recipe.distributed_config = types.SimpleNamespace(autocast_dtype=None,
                                                    defer_fsdp_grad_sync=True)
  recipe.model_parts, recipe._dllm_loss_buffer = [model], []
  # NeMo's per-example self-conditioning coins, set to our rows (the one injection).
  recipe._decide_self_conditioning = lambda batch_size, microbatch_idx=0: torch.as_tensor(
      sc_rows_B)
  return recipe


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  # NeMo's expert activation is wrapped in torch.compile; eager computes the same values
  # without a compile of tens of seconds on this CPU.
  with torch._dynamo.config.patch(disable=True):
    yield build_world(tmp_path_factory)


def build_world(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("nemo")
  config = make_config(train=write_jsonl(tmp / "train.jsonl", CONVERSATIONS), canvas_length=C,
                       prompt_len=PROMPT_LEN, num_canvases=NUM_CANVASES, num_threads=0)
  config.model.update(dict(
      hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=16, global_head_dim=32, num_global_kv_heads=1, sliding_window=12, num_experts=4,
      top_k_experts=2, moe_intermediate_size=24, layer_types=(), qk_norm_init=1.0,
      moe_impl="ragged_dot"))  # the smallest program to compile; every impl is exact
  task = chat.from_config(config)
  tok, layout = task.tokenizer, task.layout
  examples = task.train_examples(0, 6)  # one epoch: every example once
  assert len({(e.source, e.target_ids) for e in examples}) == 6
  cfg = run_config.build(config).model
  params = random_params(cfg)
  b = len(examples)
  k, g = losses.self_conditioning_rows(b, SC_PROB)
  sc_rows_B = np.arange(b) % g < k

  # Ours: the task's layout.
  rows = [task.layout_example(e) for e in examples]
  batch = {key: np.stack([r[key] for r in rows]) for key in ("tokens", "valid", "loss_mask")}

  # NeMo: our export through its adapter, then its collator, corruption and response window.
  tensors = {n: torch.from_numpy(np.array(f())) for n, _, _, f in
             hf_weights.hf_tensor_specs(cfg, params)}
  hf = hf_weights.config_to_hf(cfg, "float32")
  hf_config = DiffusionGemmaConfig(**{k_: v for k_, v in hf.items()
                                      if k_ not in ("architectures", "model_type")})
  # Float32 master weights, experts included (NeMo's recipes set this as model.torch_dtype).
  hf_config.text_config.dtype = torch.float32
  backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", experts="torch",
                          dispatcher="torch", rope_fusion=False)
  torch.manual_seed(0)
  model = DiffusionGemmaForBlockDiffusion(hf_config, backend=backend,
                                          freeze_router=False).float()
  missing, unexpected = model.load_state_dict(model.state_dict_adapter.from_hf(tensors),
                                              strict=False)
  assert not missing and not unexpected
  model.train()
  samples = [{"input_ids": list(e.prompt_ids) + list(e.target_ids),
              "loss_mask": [0] * len(e.prompt_ids) + [1] * len(e.target_ids),
              "attention_mask": [1] * (len(e.prompt_ids) + len(e.target_ids))} for e in examples]
  nemo_batch = DLLMCollator(pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, block_size=C,
                            response_window=True)(samples)
  recipe = bare_recipe(model, cfg, tok, sc_rows_B)
  batches = [dict(nemo_batch)]
  raw_noise, raw_supervised = recipe.dllm_strategy.pre_step(recipe, batches)
  noisy_nemo = batches[0]["_noisy_input_ids"].clone()
  num_diffusion, num_ar = recipe._compute_loss_denominators(batches, raw_noise, raw_supervised)
  window = batches[0]["_window"]
  captured = {}
  hook = model.register_forward_hook(
      lambda module, args, kwargs, out: captured.update(kwargs=kwargs, out=out),
      with_kwargs=True)
  loss_buffer = []
  recipe.dllm_strategy.forward_backward(recipe, 0, batches[0], loss_buffer=loss_buffer,
                                        num_diffusion_tokens=num_diffusion,
                                        num_ar_tokens=num_ar, num_batches=1)
  hook.remove()
  nemo_grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}

  # The same draws for ours: NeMo's noisy reply, cut into our canvases, and its canvas choice.
  prompt_lens = np.array([len(e.prompt_ids) for e in examples])
  filled = np.array([-(-len(e.target_ids) // C) * C for e in examples])
  noisy_canvases_BxKxC = np.array(batch["tokens"][:, PROMPT_LEN:]).reshape(b, NUM_CANVASES, C)
  for i in range(b):
    reply = noisy_nemo[i, prompt_lens[i]:prompt_lens[i] + filled[i]].numpy()
    noisy_canvases_BxKxC[i, :filled[i] // C] = reply.reshape(-1, C)
  canvas_loss_BxR = window["loss_mask"].numpy()
  selected_B = canvas_loss_BxR.reshape(b, -1, C).any(-1).argmax(-1)
  assert (canvas_loss_BxR.reshape(b, -1, C).any(-1).sum(-1) == 1).all()  # one canvas each
  return types.SimpleNamespace(**locals())


def draws_one(w):
  """NeMo's canvas choice and corruption as our Draws (t is unused by the flat CE)."""
  b = w.b
  return losses.Draws(jnp.asarray(w.selected_B), jnp.ones((b,)),
                      jnp.asarray(w.noisy_canvases_BxKxC[np.arange(b), w.selected_B]))


def draws_all(w):
  b, k = w.b, NUM_CANVASES
  return losses.Draws(jnp.tile(jnp.arange(k), b), jnp.ones((b * k,)),
                      jnp.asarray(w.noisy_canvases_BxKxC.reshape(b * k, C)))


def our_encoder(w):
  cache = transformer.init_cache(w.cfg, w.b, w.layout.seq_len)
  hidden, cache = jax.jit(transformer.encode, static_argnums=1)(
      w.params, w.cfg, jnp.asarray(w.batch["tokens"]), cache, jnp.asarray(w.batch["valid"]))
  return np.asarray(transformer.lm_head(w.params, hidden, w.cfg)), cache


def nemo_forward(w, sc_B):
  """NeMo's training forward on the recipe's window with the given self-conditioning coins."""
  kwargs = dict(w.captured["kwargs"], do_self_conditioning=torch.as_tensor(sc_B))
  with torch.no_grad():
    return w.model(**kwargs)


def relative_error(ours, theirs):
  return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def test_our_export_is_what_nemo_loads(world):
  """NeMo's adapter maps its loaded model back to our exported tensors exactly; the per-expert
  scale is folded into the experts' down projection on its side."""
  back = world.model.state_dict_adapter.to_hf(world.model.state_dict())
  ours = {n: t.numpy() for n, t in world.tensors.items() if not n.startswith(hf_weights.ENCODER)}
  assert set(back) == set(ours)
  for name, theirs in back.items():
    theirs = theirs.detach().numpy()
    if name.endswith("experts.down_proj"):
      scale = ours[name.replace("experts.down_proj", "router.per_expert_scale")]
      np.testing.assert_allclose(theirs, ours[name] * scale[:, None, None], rtol=1e-6)
    elif name.endswith("router.per_expert_scale"):
      np.testing.assert_array_equal(theirs, np.ones_like(ours[name]))
    else:
      np.testing.assert_array_equal(theirs, ours[name], err_msg=name)


def test_encoder_next_token_logits_match(world):
  w = world
  ours, _ = our_encoder(w)
  theirs = w.captured["out"].encoder_logits.detach().numpy()
  for i in range(w.b):
    n = w.prompt_lens[i] + w.filled[i]  # every real token: prompt, reply, EOS fill
    diff = np.abs(ours[i, PROMPT_LEN - w.prompt_lens[i]:PROMPT_LEN + w.filled[i]]
                  - theirs[i, :n]).max()
    assert diff < LOGIT_TOL, (i, diff)


@pytest.mark.parametrize("self_conditioning", ["off", "our_rows"])
def test_decoder_logits_match_for_every_canvas(world, self_conditioning):
  """NeMo denoises every canvas of the reply in one pass under its block-causal mask; ours
  denoises canvas k alone over the encoder cache of everything before it."""
  w = world
  sc_B = w.sc_rows_B if self_conditioning == "our_rows" else np.zeros(w.b, bool)
  theirs = nemo_forward(w, sc_B).logits.numpy()
  if self_conditioning == "our_rows":  # the recipe's own forward ran with these coins
    np.testing.assert_array_equal(theirs, w.captured["out"].logits.detach().numpy())
  _, cache = our_encoder(w)
  decode = jax.jit(transformer.decode, static_argnums=1)
  worst = 0.0
  for k in range(NUM_CANVASES):
    start = jnp.full((w.b,), PROMPT_LEN + k * C)
    noisy = jnp.asarray(w.noisy_canvases_BxKxC[:, k])
    first = decode(w.params, w.cfg, noisy, cache, start)
    ours = np.asarray(decode(w.params, w.cfg, noisy, cache, start, first, jnp.asarray(sc_B)))
    for i in np.nonzero(w.filled > k * C)[0]:  # canvases of the reply only
      diff = np.abs(ours[i] - theirs[i, k * C:(k + 1) * C]).max()
      worst = max(worst, diff)
      assert diff < LOGIT_TOL, (k, i, diff)
  assert worst > 0  # two implementations: equal only within rounding


def our_loss(w, loss_cfg, draws):
  """sft_loss's total and metrics with the given draws (the rng is then unused)."""
  batch = {k: jnp.asarray(v) for k, v in w.batch.items()}
  total, metrics = jax.jit(losses.sft_loss, static_argnums=(1, 2, 3))(
      w.params, w.cfg, loss_cfg, w.layout, batch, jax.random.PRNGKey(0), draws)
  return float(total), {k: float(v) for k, v in metrics.items()}


def nemo_objective_loss_and_grads(w):
  """sft_loss under NEMO_OBJECTIVE with NeMo's draws: (total, metrics, grads); computed once,
  for the tests that need it."""
  if hasattr(w, "nemo_objective"):
    return w.nemo_objective
  batch = {k: jnp.asarray(v) for k, v in w.batch.items()}
  fn = jax.jit(jax.value_and_grad(losses.sft_loss, has_aux=True), static_argnums=(1, 2, 3))
  (total, metrics), grads = fn(w.params, w.cfg, NEMO_OBJECTIVE, w.layout, batch,
                               jax.random.PRNGKey(0), draws_one(w))
  w.nemo_objective = float(total), {k: float(v) for k, v in metrics.items()}, grads
  return w.nemo_objective


NEMO_OBJECTIVE = losses.LossConfig(encoder_weight=1.0, decoder_weight=1.0,
                                   encoder_scope="prompt_and_target", canvas_selection="one",
                                   self_conditioning_prob=SC_PROB)


def test_loss_terms_and_total_match(world):
  w = world
  total, metrics, _ = nemo_objective_loss_and_grads(w)
  theirs_total = float(w.loss_buffer[0])
  theirs_diffusion = float(w.recipe._dllm_loss_buffer[0])
  np.testing.assert_allclose(metrics["decoder_loss"], theirs_diffusion, rtol=LOSS_RTOL)
  np.testing.assert_allclose(metrics["encoder_loss"], theirs_total - theirs_diffusion,
                             rtol=LOSS_RTOL)
  np.testing.assert_allclose(total, theirs_total, rtol=LOSS_RTOL)
  # NeMo's own AR term, recomputed from its encoder logits, is the difference above.
  out = w.captured["out"]
  ar = encoder_ar_loss(out.encoder_logits.detach(), w.nemo_batch["input_ids"],
                       valid_mask=w.nemo_batch["attention_mask"].bool())
  np.testing.assert_allclose(metrics["encoder_loss"], float(ar), rtol=LOSS_RTOL)


def test_our_default_encoder_scope_is_nemo_ar_loss_on_the_reply(world):
  """encoder_scope "target" (ours by default): next-token pairs whose target is a reply or
  fill token, the last prompt token predicting the first reply token."""
  w = world
  loss_cfg = losses.LossConfig(encoder_weight=1.0, encoder_scope="target",
                               self_conditioning_prob=SC_PROB)
  _, metrics = our_loss(w, loss_cfg, draws_one(w))
  reply = w.nemo_batch["loss_mask"].bool()
  before_reply = torch.roll(reply, -1, dims=1) & ~reply
  ar = encoder_ar_loss(w.captured["out"].encoder_logits.detach(), w.nemo_batch["input_ids"],
                       valid_mask=reply | before_reply)
  np.testing.assert_allclose(metrics["encoder_loss"], float(ar), rtol=LOSS_RTOL)


def test_gradients_of_the_total_match(world):
  w = world
  _, _, grads = nemo_objective_loss_and_grads(w)
  ours = {n: np.asarray(f()) for n, _, _, f in hf_weights.hf_tensor_specs(w.cfg, grads)
          if not n.startswith(hf_weights.ENCODER)}
  theirs = {n: t.detach().numpy() for n, t in
            w.model.state_dict_adapter.to_hf({k: torch.from_numpy(v)
                                              for k, v in w.nemo_grads.items()}).items()}
  weights = {n: t.numpy() for n, t in w.tensors.items()}
  compared = 0
  for name, g in ours.items():
    if name.endswith("layer_scalar"):  # a fixed buffer on both sides
      assert not g.any() and name not in theirs
      continue
    if name.endswith("router.per_expert_scale"):
      # NeMo trains scale * down as one tensor: dL/dscale_e = sum(down_e * dL/d(scale*down)_e).
      down = name.replace("router.per_expert_scale", "experts.down_proj")
      expected = (weights[down] * theirs[down]).sum(axis=(1, 2))
    elif name.endswith("experts.down_proj"):
      scale = weights[name.replace("experts.down_proj", "router.per_expert_scale")]
      expected = theirs[name] * scale[:, None, None]
    else:
      expected = theirs[name]
    assert np.abs(expected).max() > 0, name
    err = relative_error(g, expected)
    assert err < GRAD_TOL, (name, err)
    compared += 1
  assert compared == len(ours) - w.cfg.num_layers


def test_all_canvases_match_nemo_all_canvas_forward(world):
  """canvas_selection "all" (every canvas of every reply, each over the clean ones before it)
  against NeMo's all-canvas block-causal forward scored on every reply position."""
  w = world
  loss_cfg = losses.LossConfig(encoder_weight=0.0, decoder_weight=1.0, canvas_selection="all",
                               self_conditioning_prob=1.0)
  _, metrics = our_loss(w, loss_cfg, draws_all(w))
  out = nemo_forward(w, np.ones(w.b, bool))
  window = w.window
  theirs = BlockDiffusionCrossEntropyLoss()(
      logits=out.logits, target_ids=window["target_ids"], noise_mask=window["noise_mask"],
      p_mask=window["p_mask"], loss_mask=~window["decoder_padding_mask"]).total_loss
  np.testing.assert_allclose(metrics["decoder_loss"], float(theirs), rtol=LOSS_RTOL)


def test_example_normalization_is_the_mean_of_per_example_losses(world):
  """normalization "example": NeMo's per-token reductions, one example at a time, averaged."""
  w = world
  loss_cfg = dataclasses.replace(NEMO_OBJECTIVE, normalization="example")
  _, metrics = our_loss(w, loss_cfg, draws_one(w))
  out, window = w.captured["out"], w.window
  enc, dec = [], []
  for i in range(w.b):
    row = slice(i, i + 1)
    enc.append(float(encoder_ar_loss(out.encoder_logits.detach()[row],
                                     w.nemo_batch["input_ids"][row],
                                     valid_mask=w.nemo_batch["attention_mask"][row].bool())))
    dec.append(float(BlockDiffusionCrossEntropyLoss()(
        logits=out.logits.detach()[row], target_ids=window["target_ids"][row],
        noise_mask=window["noise_mask"][row], p_mask=window["p_mask"][row],
        loss_mask=window["loss_mask"][row]).total_loss))
  np.testing.assert_allclose(metrics["encoder_loss"], np.mean(enc), rtol=LOSS_RTOL)
  np.testing.assert_allclose(metrics["decoder_loss"], np.mean(dec), rtol=LOSS_RTOL)
  # The two reductions differ on this batch (replies of 1 to 3 canvases) by far more than the
  # tolerance.
  token_mean = float(w.loss_buffer[0] - w.recipe._dllm_loss_buffer[0])
  assert abs(np.mean(enc) - token_mean) > 20 * LOSS_RTOL * token_mean
