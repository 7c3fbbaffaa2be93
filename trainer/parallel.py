"""Parallelism strategies, by name: how the model is wrapped, how its optimizer is built, how
micro-batches skip gradient sync, and how checkpoints see the state.

Existing engines wherever they run: DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2's
``fully_shard`` (HSDP over a 2D mesh) and ``replicate``; ZeRO-1 beside tensor or pipeline
parallel is traind's own (trainer/zero.py), as ZeroRedundancyOptimizer takes no DTensor.
A single process gets ``single`` whatever the config says (there is nothing to wrap), unless
``parallel.single_rank_group`` asks for the strategy's real path on one rank.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from traind.trainer.optim import adamw_kernel, build_optimizer, param_groups
from traind.trainer.precision import POLICIES
from traind.trainer.zero import ShardedAdamW, held

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

    from torch.distributed.device_mesh import DeviceMesh

    from traind.trainer.config import OptimConfig, ParallelConfig
    from traind.trainer.distributed import DistInfo


def _dcp_state() -> ModuleType:
    """torch.distributed.checkpoint.state_dict, imported by the sharded checkpoints that use
    it: it imports DTensor, 0.5 s of the start-up of every job, most of which never shard."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


# One format for every sharded checkpoint, so that one written on any mesh resumes on any
# other: the optimizer's state flattened, keyed by parameter name ("optim.state.blocks.1.attn.
# q.weight.exp_avg", "optim.param_groups.blocks.1.attn.q.weight.lr"; torchtitan's choice).
# Nested, param_groups are a list that DCP saves as "param_groups.0.params": one key on every
# pipeline stage with different names in it, one stage's list wins the save (measured: the
# other stage resumed with groups that had no "betas"), and a checkpoint of another mesh has
# other lists (measured: dp2 x tp2 resumed on pp2 x dp2 found no group for its names).
def _flat_options() -> Any:
    return _dcp_state().StateDictOptions(strict=True, flatten_optimizer_state_dict=True)


class Strategy:
    """No parallelism: one process, the model as it is."""

    name: ClassVar[str] = "single"
    sharded: ClassVar[bool] = False  # checkpoints need torch.distributed.checkpoint
    ddp: ClassVar[bool] = False  # the wrapped module is DDP (a comm hook can be registered)

    def __init__(self, cfg: ParallelConfig, info: DistInfo, precision: str = "fp32") -> None:
        self.cfg, self.info = cfg, info
        self.precision = precision  # precision.mode: FSDP's mixed-precision policy follows it

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        return build_optimizer(model, cfg, self.info.device)

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        """Around the backward of every micro-batch but the last: no gradient all-reduce."""
        return contextlib.nullcontext()

    def full_state(self, model: nn.Module, opt: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state for a single-file checkpoint, the same on every rank
        count (a collective for zero1: call it on every rank; use it on rank 0)."""
        return model.state_dict(), opt.state_dict()

    def load_full_state(self, model: nn.Module, opt: torch.optim.Optimizer,
                        model_state: dict[str, Any], opt_state: dict[str, Any]) -> None:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)

    def sharded_state(self, model: nn.Module, opt: torch.optim.Optimizer
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
        """State for torch.distributed.checkpoint (DTensor shards stay shards)."""
        dcp = _dcp_state()
        return dcp.get_state_dict(model, held(opt), options=_flat_options())

    def load_sharded_state(self, model: nn.Module, opt: torch.optim.Optimizer,
                           model_state: dict[str, Any], opt_state: dict[str, Any]) -> None:
        dcp = _dcp_state()
        dcp.set_state_dict(model, held(opt), model_state_dict=model_state,
                           optim_state_dict=opt_state, options=_flat_options())


DDP_TIMING_EVERY = 10
# DDP's own figures of the last sampled iteration (nanoseconds in its logging data).
_DDP_TIMES = {"forward_compute": "forward_compute_time",
              "backward_compute": "backward_compute_time",
              "backward_comm": "backward_comm_time",
              "backward_overlap": "backward_compute_comm_overlap_time"}


def ddp_timing(logging_data: dict[str, Any]) -> dict[str, float]:
    """Seconds from ``DistributedDataParallel._get_ddp_logging_data()``: forward compute,
    backward compute, backward communication and the part of it overlapped with compute.
    Empty until DDP has sampled an iteration (the keys appear then)."""
    if "backward_comm_time" not in logging_data:
        return {}
    return {name: int(logging_data.get(key, 0)) / 1e9 for name, key in _DDP_TIMES.items()}


class DDP(Strategy):
    name = "ddp"
    ddp = True

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.info.device.index] if self.info.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the buckets, saving one copy of them.
        # broadcast_buffers off: the model's only buffers are the RoPE tables, which every
        # rank computes alike from the config. DDP's default broadcasts them at the start of
        # every forward: a collective per step for nothing, and a sync point inside forward
        # that made rank 0 wait for a slow rank there and hid it from straggler attribution
        # (seen in tests/metrics/test_straggler.py's real job: rank 0's forward took the
        # slow rank's 50 ms).
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.cfg.bucket_mb,
                                      gradient_as_bucket_view=True, broadcast_buffers=False)
        # DDP's reducer times one iteration in every ``rate`` (on CUDA with events it reads at
        # the next sampled one); the default 100 would leave short runs without a figure.
        ddp._set_ddp_runtime_logging_sample_rate(DDP_TIMING_EVERY)
        return ddp

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        assert isinstance(module, DistributedDataParallel)
        return module.no_sync()


class Zero1(DDP):
    """DDP for gradients; optimizer state sharded across ranks (ZeRO stage 1)."""

    name = "zero1"

    def optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        # Imported here: torch.distributed.optim pulls in TorchScript and its warnings.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            param_groups(model, cfg), optimizer_class=torch.optim.AdamW, lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2), **adamw_kernel(self.info.device))

    def full_state(self, model: nn.Module, opt: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # a collective: every rank takes part
        return model.state_dict(), (opt.state_dict() if self.info.rank == 0 else {})

    def sharded_state(self, model: nn.Module, opt: torch.optim.Optimizer
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
        raise ValueError("parallel.sharded_checkpoints is not supported with strategy zero1 "
                         "(its optimizer consolidates to one file); use fsdp for sharded state")


_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp_dtypes(precision: str, reduce: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of FSDP2's MixedPrecisionPolicy for ``precision.mode``
    and ``parallel.fsdp_reduce_dtype``: parameters are gathered in the mode's compute dtype
    (fp8 in bf16, as torchtitan: its Float8Linear casts per matmul; adaptive in fp32, since
    each block's autocast decides and a block in fp32 must see fp32 weights). None: fp32, the
    sharded dtype itself; without a low param dtype the gradients are fp32 already and the
    reduce dtype is left to them, whatever ``reduce`` says."""
    dtype = POLICIES[precision].compute_dtype
    param = None if dtype == torch.float32 else dtype
    return param, (_REDUCE_DTYPES[reduce] if param is not None else None)


class FSDP(Strategy):
    """FSDP2: parameters, gradients and optimizer state sharded; each transformer block is
    one unit, so only one block's full weights exist at a time.

    Under a low precision the all-gathers carry ``param_dtype`` and the reduce-scatters
    ``parallel.fsdp_reduce_dtype`` (fp32 by default, as torchtitan): without a policy both stay
    fp32, twice the traffic of bf16, while autocast casts the gathered weights anyway."""

    name = "fsdp"
    sharded = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ValueError("parallel.strategy fsdp needs a model with .blocks")
        param, reduce = fsdp_dtypes(self.precision, self.cfg.fsdp_reduce_dtype)
        policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        for block in blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return _fsdp_no_sync(module)

    def full_state(self, model: nn.Module, opt: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        raise AssertionError("fsdp checkpoints are always sharded")


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


class MeshDP(Strategy):
    """A mesh's dp dimension under tensor or pipeline parallel, or hsdp's: FSDP2 over the dp
    sub-mesh, ``fully_shard`` for ``strategy = fsdp`` (2D, torchtitan's) and ``hsdp`` (over
    the dp mesh split in two: shard inside, replicate across), its ``replicate`` (DDP's
    semantics: whole weights, averaged gradients) for ``ddp`` and ``zero1``, whose optimizer
    state is then sharded over dp by trainer/zero.py; nothing when dp = 1. trainer/mesh.py
    says why not DistributedDataParallel itself. The parameters are DTensors (or, in a
    pipeline, each rank holds another slice of the model), so checkpoints are
    torch.distributed.checkpoint's."""

    sharded = True
    dimension: ClassVar[str]  # the name's suffix: tp, pp (or dp: hsdp alone)

    def __init__(self, cfg: ParallelConfig, info: DistInfo, precision: str,
                 dp_mesh: DeviceMesh) -> None:
        super().__init__(cfg, info, precision)
        self.dp_mesh = dp_mesh
        self.name = (f"{cfg.strategy}+{self.dimension}"  # type: ignore[misc]
                     if dp_mesh.size() > 1 else self.dimension)

    def wrap(self, model: nn.Module) -> nn.Module:
        return _dp_over_mesh(model, self.dp_mesh, self.cfg, self.precision)

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        if self.dp_mesh.size() == 1:
            return contextlib.nullcontext()
        return _fsdp_no_sync(module)

    def optimizer(self, model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        if self.cfg.strategy != "zero1" or self.dp_mesh.size() == 1:
            return super().optimizer(model, cfg)
        return ShardedAdamW(param_groups(model, cfg), group=self.dp_mesh.get_group(),
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            **adamw_kernel(self.info.device))

    def full_state(self, model: nn.Module, opt: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        raise AssertionError(f"{self.name} checkpoints are always sharded")


class TensorParallel(MeshDP):
    """``parallel.tp > 1``: the model is already DTensors over the tp sub-mesh (the loop
    applies trainer/tensor_parallel.py before compiling); this wraps it over the dp
    sub-mesh."""

    dimension = "tp"


class PipelineParallel(MeshDP):
    """``parallel.pp > 1``: the module is one pipeline stage (trainer/pipeline_parallel.py),
    over the dp sub-mesh as under tensor parallel: torchtitan's pairing, and the one
    PipelineStage drives itself (no gradient sync until the last micro-batch's backward, then
    the reduce). DistributedDataParallel fails there: its reducer records the parameter order
    once per micro-batch in the first step and then asserts (20 recorded for 10 parameters)."""

    dimension = "pp"

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        # PipelineStage turns FSDP's gradient sync back on at the end of every schedule
        # step, so with parallel.grad_accum > 1 each step reduces what has accumulated: the
        # same sums (the reduce is linear), more traffic
        return contextlib.nullcontext()


def _dp_over_mesh(model: nn.Module, dp_mesh: DeviceMesh, cfg: ParallelConfig,
                  precision: str) -> nn.Module:
    """``model`` with FSDP2 over ``dp_mesh`` per block and at the root: ``fully_shard`` for
    ``strategy = fsdp`` and ``hsdp`` (whose mesh is 2D), ``replicate`` (DDP's semantics: whole
    weights, averaged gradients) for ``ddp`` and ``zero1``; unchanged when dp = 1."""
    if dp_mesh.size() == 1:
        return model
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param, reduce = fsdp_dtypes(precision, cfg.fsdp_reduce_dtype)
    policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    # hsdp: fully_shard over the 2D (replicate, shard) mesh is FSDP2's HSDP
    apply = fully_shard if cfg.strategy in ("fsdp", "hsdp") else replicate
    blocks = model.blocks  # a GPT's ModuleList or a stage's ModuleDict
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):  # type: ignore[union-attr]
        apply(block, mesh=dp_mesh, mp_policy=policy)
    apply(model, mesh=dp_mesh, mp_policy=policy)
    return model


class ShardedReplicas(MeshDP):
    """``strategy = hsdp`` without tp or pp: FSDP2 over the 2D dp mesh alone (HSDP)."""

    dimension = "dp"

    def __init__(self, cfg: ParallelConfig, info: DistInfo, precision: str,
                 dp_mesh: DeviceMesh) -> None:
        super().__init__(cfg, info, precision, dp_mesh)
        self.name = "hsdp"  # type: ignore[misc]


# without a mesh (one rank with parallel.single_rank_group) hsdp has one shard group: fsdp
STRATEGIES: dict[str, type[Strategy]] = {
    **{s.name: s for s in (Strategy, DDP, Zero1, FSDP)}, "hsdp": FSDP}


def build_strategy(cfg: ParallelConfig, info: DistInfo, precision: str = "fp32",
                   mesh: DeviceMesh | None = None, dp_shard: int = 1) -> Strategy:
    """The strategy ``cfg.strategy`` names (``single`` on one process), for ``precision``
    (``precision.mode``); over ``mesh``'s dp dimension when there is a mesh (tp or pp > 1, or
    hsdp: trainer/mesh.py's ``needs_mesh``), which hsdp splits into (dp / ``dp_shard``,
    ``dp_shard``)."""
    if mesh is None:
        if info.world_size == 1 and not cfg.single_rank_group:
            return Strategy(cfg, info, precision)
        return STRATEGIES[cfg.strategy](cfg, info, precision)
    dp_mesh = mesh["dp"]
    if cfg.strategy == "hsdp":
        dp_mesh = dp_mesh._unflatten(0, (dp_mesh.size() // dp_shard, dp_shard),
                                     ("dp_replicate", "dp_shard"))
    if mesh["pp"].size() > 1:
        return PipelineParallel(cfg, info, precision, dp_mesh)
    if mesh["tp"].size() > 1:
        return TensorParallel(cfg, info, precision, dp_mesh)
    return ShardedReplicas(cfg, info, precision, dp_mesh)
