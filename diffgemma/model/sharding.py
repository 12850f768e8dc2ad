"""One device mesh with named axes, and logical axis rules that place params and activations.

Mesh axes: data (pure data parallelism), fsdp (batch split and dense weights sharded, gathered
per layer as they are used), expert (the stacked experts split by expert), tensor (heads and
hidden units split). Every parameter and the activations that matter carry logical axis names
("embed", "heads", "experts", "batch", ...); the config's rules map each logical name to mesh
axes, so an ablation of the layout is a config edit:

    --config.sharding.fsdp=2 --config.sharding.rules.experts=expert

A logical axis whose size a mesh axis does not divide stays unsplit on that mesh axis (e.g. two
KV heads on a tensor axis of 4), and a mesh axis is used at most once per array.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diffgemma.model import lora

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axes of each parameter (by the end of its dotted path) come from the modules'
# partitioning metadata (`nn.with_logical_partitioning` in `layers.Module.weight`, read by
# `transformer.logical_axes_table`, which registers itself here when diffgemma/model/transformer.py
# is imported: this file sits below it); vectors and scalars (norms, scales, layer scalars) carry
# none and are replicated.
_PARAM_AXES_SOURCE = None


def set_param_axes_source(source) -> None:
  global _PARAM_AXES_SOURCE
  _PARAM_AXES_SOURCE = source


def param_axes() -> dict[str, tuple[str, ...]]:
  """{weight name ("attn.q", "experts.gate_up", ...): logical axes}."""
  if _PARAM_AXES_SOURCE is None:
    raise RuntimeError("the logical axes of the parameters come from "
                       "diffgemma.model.transformer; import it first")
  return _PARAM_AXES_SOURCE()


LORA_RANK = "lora_rank"

# Activation layouts used by the model (see `constrain`).
HIDDEN = ("batch", "length", "act_embed")
LOGITS = ("batch", "length", "act_vocab")
BATCH = ("batch", "length")

DEFAULT_RULES = {
    "batch": "data,fsdp,expert", "length": "",
    "vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "head_dim": "",
    "mlp": "tensor", "experts": "expert", "expert_mlp": "tensor", "router_experts": "",
    LORA_RANK: "", "act_embed": "", "act_vocab": "tensor",
}


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """Mesh axis sizes (-1: all remaining devices; at most one) and logical -> mesh axis rules
  ("fsdp", "data,fsdp" for several, "" for replicated)."""

  data: int = 1
  fsdp: int = -1
  expert: int = 1
  tensor: int = 1
  rules: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

  def __post_init__(self):
    sizes = self.axis_sizes_raw()
    if sum(s == -1 for s in sizes.values()) > 1:
      raise ValueError(f"sharding: at most one mesh axis may be -1, got {sizes}")
    for name, size in sizes.items():
      if size == 0 or size < -1:
        raise ValueError(f"sharding.{name}={size}: a mesh axis size is >= 1 or -1 (the rest)")
    rules = dict(DEFAULT_RULES)
    rules.update(self.rules)
    for logical, axes in rules.items():
      for axis in _split(axes):
        if axis not in MESH_AXES:
          raise ValueError(f"sharding.rules.{logical}={axes!r}: unknown mesh axis {axis!r}; "
                           f"mesh axes are {MESH_AXES}")
    object.__setattr__(self, "rules", rules)

  def axis_sizes_raw(self) -> dict[str, int]:
    return {name: getattr(self, name) for name in MESH_AXES}

  def axis_sizes(self, num_devices: int) -> dict[str, int]:
    """Sizes with -1 resolved so that the product is `num_devices`."""
    sizes = self.axis_sizes_raw()
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    for name, size in sizes.items():
      if size == -1:
        if num_devices % fixed:
          raise ValueError(f"sharding mesh {sizes} does not divide {num_devices} devices")
        sizes[name] = num_devices // fixed
    return sizes


def _split(axes: str) -> tuple[str, ...]:
  return tuple(a.strip() for a in axes.split(",") if a.strip())


def make_mesh(cfg: ShardingConfig, devices=None) -> Mesh:
  """The mesh over the first prod(sizes) devices (all of them on several hosts)."""
  devices = list(jax.devices() if devices is None else devices)
  has_free_axis = -1 in cfg.axis_sizes_raw().values()
  sizes = cfg.axis_sizes(len(devices) if has_free_axis else
                         int(np.prod(list(cfg.axis_sizes_raw().values()))))
  needed = int(np.prod(list(sizes.values())))
  if needed > len(devices):
    raise ValueError(f"sharding mesh {sizes} needs {needed} devices, found {len(devices)} "
                     "(change --config.sharding.* or run on more devices)")
  if jax.process_count() > 1 and needed != len(devices):
    raise ValueError(f"on several hosts the mesh must span all {len(devices)} devices, "
                     f"got {sizes}")
  grid = np.array(devices[:needed], dtype=object).reshape([sizes[a] for a in MESH_AXES])
  return Mesh(grid, MESH_AXES)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
  """Logical axis names of the array at a dotted path: a parameter ("layers.0.attn.q"), a LoRA
  factor ("layers.0.attn.q.a" / ".b"), a quantized weight's values or scales (".qvalue" /
  ".scale": the weight's axes; a scale axis of size 1 stays unsplit), or an optimizer-state copy
  of any of them (any prefix)."""
  if path.endswith((".qvalue", ".scale")):
    path = path.rsplit(".", 1)[0]
  factor = None
  if path.endswith((".a", ".b")):
    path, factor = path[:-2], path[-1]
  for suffix, axes in param_axes().items():
    if path == suffix or path.endswith("." + suffix):
      if factor:
        num_expert, num_in = lora.LINEAR_LAYOUTS[suffix]
        split = num_expert + num_in
        axes = (axes[:split] + (LORA_RANK,) if factor == "a"
                else axes[:num_expert] + (LORA_RANK,) + axes[split:])
      if len(axes) == ndim:
        return axes
  return (None,) * ndim


def partition_spec(axes, shape, mesh: Mesh, rules: dict[str, str]) -> PartitionSpec:
  """Mesh axes per array axis by the rules, keeping only mesh axes that divide the size."""
  used, spec = set(), []
  for name, size in zip(axes, shape):
    keep, split = [], 1
    for axis in _split(rules.get(name, "")) if name else ():
      n = mesh.shape[axis]
      if axis in used or n == 1 or size % (split * n):
        continue
      keep.append(axis)
      split *= n
    used.update(keep)
    spec.append(tuple(keep) if len(keep) > 1 else (keep[0] if keep else None))
  return PartitionSpec(*spec)


def tree_shardings(tree, mesh: Mesh, rules: dict[str, str]):
  """NamedSharding for every array leaf of a params / adapters / optimizer-state tree."""
  def visit(path, x):
    shape = getattr(x, "shape", ())
    axes = logical_axes(lora.dotted(path), len(shape))
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules))

  return jax.tree_util.tree_map_with_path(visit, tree)


def batch_sharding(mesh: Mesh, rules: dict[str, str], shape) -> NamedSharding:
  return NamedSharding(mesh, partition_spec(BATCH[:len(shape)], shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: dict, mesh: Mesh, rules: dict[str, str]) -> dict:
  """This process's rows of a batch -> global arrays split over the batch's mesh axes. An
  array that is global already (a program's output on a multi-process mesh, e.g. SD·RL's
  states) is only moved onto the batch's sharding."""
  def place(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, batch_sharding(mesh, rules, x.shape))
    x = np.asarray(x)
    global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules, global_shape), x,
                                                  global_shape)

  return jax.tree_util.tree_map(place, local_batch)


# ----------------------------------------------------------------------------- activations

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("diffgemma_sharding", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: dict[str, str]):
  """Within this context (around tracing), `constrain` pins activations to the mesh."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
  """The mesh of the enclosing `activation_rules`, or None outside it or on one device."""
  active = _ACTIVE.get()
  return None if active is None or active[0].size == 1 else active[0]


def active_spec(axes, shape) -> PartitionSpec:
  """`partition_spec` of logical `axes` under the enclosing `activation_rules`."""
  mesh, rules = _ACTIVE.get()
  return partition_spec(axes, shape, mesh, rules)


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, "fsdp" or ("data", "fsdp"))."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def batch_shards(batch: int) -> int:
  """Into how many pieces `constrain` splits a batch axis of this size (1 outside
  `activation_rules`)."""
  active = _ACTIVE.get()
  if active is None:
    return 1
  mesh, rules = active
  axes = entry_axes(partition_spec(("batch",), (batch,), mesh, rules)[0])
  return int(np.prod([mesh.shape[a] for a in axes]))


def constrain(x, axes: tuple[str, ...]):
  """with_sharding_constraint by logical axes; a no-op outside `activation_rules` or on a mesh
  of one device."""
  active = _ACTIVE.get()
  if active is None or active[0].size == 1:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, partition_spec(axes, x.shape, mesh, rules)))
