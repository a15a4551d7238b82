"""ZeRO-3 (sharded parameters, gradients and optimizer states) through PyTorch's FSDP2.

ZeRO stage 3 (Rajbhandari et al. 2020, section 5.3) keeps only 1/d of every parameter on
each DP rank and all-gathers a layer's parameters just before they are needed. autopar
does not reimplement it: :class:`FullyShardedOptimizer` applies ``fully_shard``
(``torch.distributed.fsdp``, FSDP2) to the rewritten stage and drives a plain torch
optimizer over the resulting sharded (DTensor) parameters. Its interface is that of
:class:`autopar.runtime.zero.DistributedOptimizer`, so the engine runs either.

Units (what is all-gathered at once), as torchtitan wraps a transformer:

* one unit per transformer layer: the stage GraphModule's ``call_module`` submodules that
  own parameters, grouped by their node's ``meta["autopar_layer"]`` (TP-rewritten modules,
  inserted collectives and ``recompute_layer_*`` checkpoints inherit it from the node they
  follow), ``fully_shard`` over the list, ``reshard_after_forward=True``;
* the root unit: everything else (embeddings, ln_f, lm_head; the tied wte/lm_head weight
  is one Parameter), with FSDP2's default for the root: not resharded after forward,
  because its backward starts right after the forward.

Per micro-batch, over the DP group (payloads as :class:`~autopar.runtime.stats.CommMeter`
counts them; S_u = sum over unit u's parameters of ceil(dim0/d) * numel/dim0, FSDP2's
dim-0 padding of each parameter to a multiple of d):

* all-gather, forward: every unit, S_u elements of ``param_dtype`` each;
* all-gather, backward: every layer unit again (it was resharded); the root is still
  unsharded. Full recompute re-runs a layer's forward inside its backward, after the
  unit's pre-backward all-gather, so it adds none;
* reduce-scatter: every unit, d * S_u elements of ``reduce_dtype`` (FSDP2 reduces each
  micro-batch's gradient and accumulates the fp32 shard), averaged over d
  (``ReduceOp.AVG``, FSDP2's default divide factor d): with every micro-batch loss scaled
  by 1/m the accumulated shard is the mean gradient over the DP-global batch.

Mixed precision (``param_dtype`` bf16): the sharded fp32 parameters are the master
weights; FSDP2 casts them to bf16 for the all-gather and the compute
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``) and keeps the reduced
gradient shard in fp32. Model states per parameter with Adam: 4/d (fp32 shard) + 4/d
(fp32 gradient shard) + 8/d (m, v) = 16/d bytes, the cost model's (2 + 2 + 12)/d.

Like DeepSpeed, ZeRO-3 is not combined with pipeline parallelism (the pipeline schedule
would own FSDP's per-micro-batch hooks); the engine rejects pp > 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from autopar.runtime.health import square_sum
from autopar.contract.support import FULLY_SHARDED_STAGE

__all__ = ["FullyShardedOptimizer", "FULLY_SHARDED_STAGE", "layer_units", "full_tensor"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded (DTensor) parameter or gradient, all-gathered over
    its DP mesh (collective: every DP rank must call it in the same order); other tensors
    are returned as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def layer_units(stage: fx.GraphModule) -> tuple[list[list[nn.Module]], list[nn.Module]]:
    """Group the stage's parameter-owning ``call_module`` submodules by layer.

    Returns (units, rest): units[i] is the i-th layer present (in graph order), a list of
    modules; rest holds the modules with no ``autopar_layer`` (they go to the root unit).
    """
    by_layer: dict[int, list[nn.Module]] = {}
    rest: list[nn.Module] = []
    seen: set[int] = set()
    for node in stage.graph.nodes:
        if node.op != "call_module":
            continue
        module = stage.get_submodule(node.target)
        if id(module) in seen or next(module.parameters(), None) is None:
            continue
        seen.add(id(module))
        layer = node.meta.get("autopar_layer")
        (rest if layer is None else by_layer.setdefault(layer, [])).append(module)
    return [by_layer[l] for l in sorted(by_layer)], rest


class FullyShardedOptimizer:
    """ZeRO-3 over the DP mesh with FSDP2 (see the module docstring).

    Args:
        stage: this rank's stage (a GraphModule after the TP and recompute passes), fp32
            parameters; it is sharded in place.
        optimizer_factory: builds a torch optimizer from the sharded parameters (any
            optimizer that accepts DTensors: SGD, Adam, AdamW, ...).
        dp_mesh: the 1-D data-parallel DeviceMesh (``groups.device_mesh["dp"]``).
        param_dtype: dtype of the gathered parameters, the compute and the gradient
            reduce-scatter (bf16: mixed precision); None keeps the parameters' dtype.

    Raises:
        ValueError: parameters of a dtype other than float32 (the sharded parameters are the
            master weights: keep the model in fp32 and pass ``param_dtype``), or no mesh.
    """

    zero_stage = FULLY_SHARDED_STAGE

    def __init__(self, stage: fx.GraphModule,
                 optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *,
                 dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> None:
        dtypes = {p.dtype for p in stage.parameters()}
        if dtypes - {torch.float32}:
            raise ValueError(f"ZeRO-3 keeps the sharded parameters as fp32 master weights, got "
                             f"{sorted(map(str, dtypes))}; keep the model in float32 and pass "
                             "param_dtype=torch.bfloat16 for mixed precision")
        if dp_mesh is None:
            raise ValueError("ZeRO-3 needs the data-parallel DeviceMesh; build the groups with "
                             "ParallelGroups.build and pass groups.device_mesh['dp']")
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype) \
            if param_dtype not in (None, torch.float32) else MixedPrecisionPolicy()
        units, _ = layer_units(stage)
        for modules in units:
            fully_shard(modules, mesh=dp_mesh, reshard_after_forward=True, mp_policy=policy)
        fully_shard(stage, mesh=dp_mesh, mp_policy=policy)  # root: the rest
        self.stage, self.mesh = stage, dp_mesh
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(self.params)

    def zero_grad(self) -> None:
        """Drop the previous step's (sharded) gradients."""
        for p in self.params:
            p.grad = None

    def micro_batch_done(self) -> None:
        """Nothing: FSDP2 reduce-scatters each unit's gradient in its post-backward hook."""

    def reduce_gradients(self) -> None:
        """Nothing: FSDP2 has reduce-scattered every unit's gradient during backward."""

    def grad_square_sum(self, counted: set[int]) -> torch.Tensor:
        """Sum of squares (a float64 scalar tensor) of this rank's gradient shards of the parameters in
        ``counted`` (ids); the DP shards are disjoint, so the sum over DP counts each
        element once."""
        total = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if id(p) in counted and p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                total = total.to(grad.device) + square_sum(grad.reshape(-1))
        return total

    def scale_gradients(self, factor: float) -> None:
        """Multiply the gradient shards by ``factor`` (gradient clipping)."""
        if factor == 1.0:
            return
        for p in self.params:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(factor)

    def step(self) -> None:
        """Step the optimizer on this rank's shards (the gradients are already averaged;
        the next forward all-gathers the updated parameters)."""
        self.optimizer.step()

    def synchronize_gradients(self) -> None:
        """Nothing: each ``.grad`` is the sharded DP-averaged gradient; read it whole with
        :func:`full_tensor` (a collective over DP)."""

    def state_bytes(self) -> int:
        """Bytes held for the model between steps on this rank: parameter shards, gradient
        shards and the optimizer's state shards (local tensors of the DTensors)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        total = 0
        for p in self.params:
            total += local(p).numel() * p.element_size()
            if p.grad is not None:
                total += local(p.grad).numel() * p.grad.element_size()
        for state in self.optimizer.state.values():
            total += sum(local(v).numel() * v.element_size() for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0)
        return total

