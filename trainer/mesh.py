"""The device mesh: ranks laid out as (pp, dp, tp), its rules, and its build.

The rules are pure functions of plain values and the config (``mesh_problems``), checked when
the config is validated, against the ranks the job asks for, and again at start-up against the
ranks torchrun gave (``resolve``). Nothing here imports torch at module level: the daemon
validates configs without it.

Layout: row-major over ``("pp", "dp", "tp")`` (torchtitan's order), so tp is the
fastest-varying coordinate and a tp group is consecutive ranks (one node's GPUs, joined by the
fastest links, where tensor parallel's per-layer collectives belong), and pp the slowest: the
stages of a pipeline sit farthest apart, across the slower links (between nodes), since they
only pass one activation per micro-batch to a neighbour. That is the ``fixed`` layout, right
when torchrun numbers each node's ranks consecutively; ``parallel.placement = "auto"`` lays
the ranks out from the measured link matrix instead (trainer/placement.py): ``build_mesh``
takes the rank order, and the coordinates below are of a rank's *slot* in it.

With tp > 1 the dp dimension is FSDP2's: ``fully_shard`` over the dp sub-mesh for
``parallel.strategy = fsdp`` (2D, as torchtitan), its ``replicate`` for ``ddp``, and for
``zero1`` too, with the optimizer state sharded over dp by traind's own ZeRO-1
(trainer/zero.py: ZeroRedundancyOptimizer takes no DTensor).
DistributedDataParallel itself cannot hold DTensor parameters; its ``device_mesh`` path
(``_pre_dp_module_transform``, "a temporary workaround" in torch 2.13) swaps them for plain
tensors after each forward, so ``model.parameters()`` and ``state_dict()`` lose the tp weights
(measured: a global grad norm of 0). Without DDP there is no communication hook, hence no
gradient compression with tp > 1 (``compression_unavailable``).

``parallel.strategy = hsdp`` makes the dp dimension two (``dp_replicate`` x ``dp_shard``,
``hsdp_shard``): FSDP2 over a 2D mesh shards inside each group of ``dp_shard`` consecutive dp
ranks and replicates across the groups, with or without tp and pp.

With pp > 1 each stage's module is FSDP2 over the dp sub-mesh as well (trainer/parallel.py's
``PipelineParallel`` says why not DDP), and with tp > 1 too its blocks are tensor parallel
first (3D: dp x tp x pp; trainer/pipeline_parallel.py's ``StageModule`` says what crosses a
stage boundary then); what pipeline parallel does not combine with yet is in ``pp_problems``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from traind.contracts.mesh import coordinates
from traind.errors import FieldErrors
from traind.trainer.config import compression_unavailable
from traind.trainer.footprint import mlp_hidden_width

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from traind.errors import FieldError
    from traind.trainer.config import TrainConfig


@dataclass(frozen=True, slots=True)
class MeshShape:
    dp: int
    tp: int
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def shape_problems(dp: int | None, tp: int, pp: int, world: int
                   ) -> tuple[MeshShape | None, list[FieldError]]:
    """The mesh of ``world`` ranks that ``parallel.dp/tp/pp`` ask for (dp None or 0:
    inferred), or None and why not."""
    problems: list[FieldError] = []
    if not dp:
        if world % (tp * pp):
            problems.append((("parallel", "tp"), f"tp x pp = {tp * pp} must divide the world "
                             f"size {world} (job.nproc_per_node x job.nnodes), so that dp can "
                             "be inferred"))
            return None, problems
        dp = world // (tp * pp)
    elif dp * tp * pp != world:
        problems.append((("parallel", "dp"), f"dp x tp x pp = {dp} x {tp} x {pp} = "
                         f"{dp * tp * pp} must equal the world size {world} "
                         "(job.nproc_per_node x job.nnodes); or leave dp unset to infer it"))
    return (None if problems else MeshShape(dp, tp, pp)), problems


def tp_problems(tp: int, *, n_heads: int, n_kv_heads: int, mlp_hidden: int, vocab: int,
                seq_len: int) -> list[FieldError]:
    """What ``parallel.tp`` must divide, and why: each rank holds whole query heads and (with
    grouped-query attention) whole kv heads, a share of the SwiGLU's hidden units and of the
    vocabulary rows (embedding and head), and ``seq_len / tp`` tokens of the residual stream
    (sequence parallel)."""
    if tp == 1:
        return []
    sizes = [("model.n_heads", n_heads, "each rank computes whole attention heads"),
             ("the MLP hidden width (model.mlp_hidden)", mlp_hidden,
              "the SwiGLU's hidden units are split evenly"),
             ("model.vocab_size", vocab, "the embedding and head are split by vocab rows"),
             ("model.seq_len", seq_len, "sequence parallel splits the tokens between blocks")]
    if n_kv_heads != n_heads:  # grouped-query attention: the kv heads are split too
        sizes.insert(1, ("the kv heads", n_kv_heads, "each rank holds whole key/value heads"))
    return [(("parallel", "tp"), f"{tp} must divide {what} ({n}): {why}")
            for what, n, why in sizes if n % tp]


def tie_problems(tied: bool, *, tp: int, pp: int) -> list[FieldError]:
    """Why ``model.tie_embeddings`` cannot run on this mesh (empty: it can). Tensor parallel
    shards the embedding and the head as two modules (a vocab-parallel lookup, a
    column-parallel matmul), each swapping in its own DTensor parameter, so one shared weight
    would come out as two; pipeline parallel puts the embedding on the first stage and the
    head on the last, where one weight would need its gradients summed across stages."""
    if not tied:
        return []
    return [(("model", "tie_embeddings"), f"tied embeddings with parallel.{name} = {n} > 1 "
             f"are not yet supported ({why}); untie them or use {name} = 1")
            for name, n, why in (("tp", tp, "the embedding and the head are sharded apart"),
                                 ("pp", pp, "the embedding and the head sit on different "
                                  "stages"))
            if n > 1]


def factory_problems(field: tuple[str, str] | None, *, pp: int) -> list[FieldError]:
    """Why the user's own model (at ``field``: ``model.factory`` or ``model.hf``) cannot run
    on this mesh (empty: it can).
    Pipeline parallel needs a cut of the forward into stages, which traind has for its own
    model only. Tensor parallel takes the plan the factory's module carries (``tp_plan``,
    trainer/factory.py), which only the built module can show: admission's child process
    checks it (daemon/admission.factory_params), and the worker again when it applies it."""
    if field is None or pp == 1:
        return []
    kind = "a factory model" if field[1] == "factory" else f"a model.{field[1]} model"
    return [(field, f"{kind} with parallel.pp = {pp} > 1 needs a "
             "split into pipeline stages traind cannot read off an arbitrary module; use "
             "pp = 1 (tensor parallel through the module's tp_plan, data parallel: ddp, "
             "zero1 or fsdp)")]


# The precision modes a pipeline runs: fp16's loss scale is applied in the schedule's loss
# and an overflow on any stage skips the step on all (Pipeline, agree_on_overflow); fp8
# swaps the Linear layers of the full model before the split; adaptive measures and decides
# each stage's own groups and shares every window's figures over the stages
# (AdaptivePolicy.split_over_stages), so every rank knows every group's mode.
PP_PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "adaptive")


def microbatch_problems(pp: int, *, schedule: str, microbatches: int,
                        batch_size: int) -> list[str]:
    """Why ``microbatches`` cannot run ``schedule`` over ``pp`` stages on batches of
    ``batch_size`` (empty: they can); torch.distributed.pipelining's own rules."""
    problems = []
    # ScheduleInterleaved1F1B runs the micro-batches in rounds of at most pp
    if schedule == "interleaved_1f1b" and microbatches % (rounds := max(1, microbatches // pp)):
        problems.append(f"interleaved_1f1b runs {microbatches} micro-batches in {rounds} "
                        f"rounds of pp = {pp}; {rounds} must divide them (a multiple of pp, "
                        "or fewer than it)")
    if schedule == "1f1b" and microbatches < pp:
        problems.append(f"1f1b needs at least one micro-batch per stage (got {microbatches} "
                        f"for parallel.pp = {pp}); raise it or use pp_schedule gpipe")
    if batch_size % microbatches:
        problems.append(f"{microbatches} must divide job.batch_size ({batch_size}): the "
                        "pipeline splits each batch into equal micro-batches")
    return problems


def default_microbatches(pp: int, *, schedule: str, batch_size: int) -> int | None:
    """``parallel.microbatches`` when the config leaves it at 0: 1 without a pipeline; pp
    when pp divides ``batch_size`` (one micro-batch per stage in the steady state: the fewest
    that fill the pipeline, and a multiple of pp, as Megatron-LM's interleaving asks); else
    micro-batches of one sequence, ``batch_size`` of them (torchtitan's default), if at least
    pp and ``schedule`` runs them; else None. Between the two, more micro-batches shrink the
    bubble, (pp-1)/(m+pp-1), and every micro-batch's matmuls with it: the user's choice."""
    if pp == 1:
        return 1
    return next((m for m in (pp, batch_size) if m >= pp and not microbatch_problems(
        pp, schedule=schedule, microbatches=m, batch_size=batch_size)), None)


def job_microbatches(cfg: TrainConfig) -> int:
    """The micro-batches the pipeline of a validated ``cfg`` runs: ``parallel.microbatches``,
    or (0) :func:`default_microbatches`."""
    p = cfg.parallel
    m = p.microbatches or default_microbatches(p.pp, schedule=p.pp_schedule,
                                               batch_size=cfg.job.batch_size)
    assert m is not None, "mesh_problems refuses a pipeline with no micro-batch count"
    return m


def pp_problems(pp: int, *, schedule: str, microbatches: int, n_layers: int, batch_size: int,
                dp: int, precision: str,
                virtual: int = 2) -> list[FieldError]:
    """What ``parallel.pp`` needs of the rest of the config, and why (empty: it runs).
    ``dp`` is the mesh's (inferred or given); ``microbatches`` 0 is derived."""
    if pp == 1:
        return []
    problems: list[FieldError] = []
    if pp > n_layers:
        problems.append((("parallel", "pp"), f"{pp} stages need at least as many blocks; "
                         f"model.n_layers is {n_layers}"))
    if schedule == "interleaved_1f1b":
        if pp * virtual > n_layers:
            problems.append((("parallel", "pp_virtual_stages"), f"interleaved_1f1b's "
                             f"{pp} x {virtual} stages need at least as many blocks; "
                             f"model.n_layers is {n_layers}"))
        if dp > 1:
            problems.append((("parallel", "pp_schedule"), "interleaved_1f1b with dp > 1 is "
                             "not yet supported (FSDP over each looped stage); use gpipe or "
                             "1f1b, or dp = 1"))
    if microbatches:
        problems += [(("parallel", "microbatches"), why) for why in microbatch_problems(
            pp, schedule=schedule, microbatches=microbatches, batch_size=batch_size)]
    elif default_microbatches(pp, schedule=schedule, batch_size=batch_size) is None:
        # 1f1b runs any batch of at least pp sequences, one each; gpipe and interleaving
        # run some counts the derivation does not try (fewer than pp, or between the two)
        other = (f", or parallel.microbatches to a divisor of it that {schedule} runs"
                 if schedule != "1f1b" else "")
        problems.append((("parallel", "microbatches"), f"left at 0, it is derived from "
                         f"parallel.pp = {pp} and job.batch_size = {batch_size}: pp micro-"
                         f"batches when pp divides the batch, else one per sequence when "
                         f"{schedule} runs that many, and neither fits; set job.batch_size "
                         f"to a multiple of {pp}{other}"))
    if precision not in PP_PRECISIONS:
        problems.append((("precision", "mode"), f"{precision} with parallel.pp > 1 is not "
                         f"yet supported; use {' or '.join(PP_PRECISIONS)}"))
    return problems


def hsdp_shard(dp: int, *, tp: int, dp_shard: int, nproc_per_node: int) -> int:
    """The dp ranks each parameter is sharded over under ``strategy = hsdp``:
    ``parallel.dp_shard``, or (0) the dp ranks of one node: its ``nproc_per_node``
    consecutive slots hold ``nproc_per_node / tp`` dp coordinates of one stage (tp varies
    fastest), at most dp. The mesh's dp dimension is then (dp / shard, shard): the shards are
    consecutive dp coordinates, so they sit on one node's links and only the replicas'
    all-reduce crosses between nodes."""
    return dp_shard or max(1, min(dp, nproc_per_node // tp))


def hsdp_problems(strategy: str, *, dp: int, tp: int, dp_shard: int,
                  nproc_per_node: int) -> list[FieldError]:
    """What ``strategy = hsdp`` needs of the mesh, and why (empty: it runs, or another
    strategy is asked for)."""
    if strategy != "hsdp" or dp == 1:
        return []
    shard = hsdp_shard(dp, tp=tp, dp_shard=dp_shard, nproc_per_node=nproc_per_node)
    if dp % shard == 0:
        return []
    said = (f"parallel.dp_shard = {dp_shard}" if dp_shard else
            f"the dp ranks of one node ({shard}: job.nproc_per_node / tp)")
    return [(("parallel", "dp_shard"), f"{said} must divide dp ({dp}): hsdp replicates "
             "the model over dp / dp_shard equal groups of sharding ranks; set "
             "parallel.dp_shard to a divisor of dp")]


def needs_mesh(shape: MeshShape, strategy: str) -> bool:
    """Whether the job runs on a DeviceMesh: tensor or pipeline parallel, or hsdp's 2D dp
    dimension; plain data parallel wraps over the default process group."""
    return shape.tp > 1 or shape.pp > 1 or (strategy == "hsdp" and shape.dp > 1)


def mesh_problems(cfg: TrainConfig, *, world: int) -> list[FieldError]:
    """Every reason ``cfg``'s mesh cannot run on ``world`` ranks (empty: it can)."""
    p, m = cfg.parallel, cfg.model
    shape, problems = shape_problems(p.dp, p.tp, p.pp, world)
    problems += pp_problems(p.pp, schedule=p.pp_schedule, microbatches=p.microbatches,
                            n_layers=m.n_layers, batch_size=cfg.job.batch_size,
                            dp=shape.dp if shape else 1,
                            precision=cfg.precision.mode, virtual=p.pp_virtual_stages)
    problems += tp_problems(p.tp, n_heads=m.n_heads, n_kv_heads=m.kv_heads,
                            mlp_hidden=mlp_hidden_width(m), vocab=m.vocab_size,
                            seq_len=m.seq_len)
    problems += tie_problems(m.tie_embeddings, tp=p.tp, pp=p.pp)
    if shape is not None:
        problems += hsdp_problems(p.strategy, dp=shape.dp, tp=p.tp, dp_shard=p.dp_shard,
                                  nproc_per_node=cfg.job.nproc_per_node)
    problems += factory_problems(m.user_field, pp=p.pp)
    if (p.tp > 1 or p.pp > 1) and (why := compression_unavailable(
            cfg.compression.method, strategy=p.strategy, ranks=world, tp=p.tp, pp=p.pp)):
        problems.append((("compression", "method"), why))
    return problems


def resolve(cfg: TrainConfig, world: int) -> MeshShape:
    """The mesh this job runs on ``world`` ranks (the ranks torchrun really started);
    ``FieldErrors`` naming the fields when it cannot."""
    shape, _ = shape_problems(cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, world)
    if problems := mesh_problems(cfg, world=world):
        raise FieldErrors(problems)
    assert shape is not None
    return shape


def build_mesh(shape: MeshShape, device_type: str, order: list[int] | None = None
               ) -> DeviceMesh:
    """The ``("pp", "dp", "tp")`` DeviceMesh over the default process group, on
    ``device_type`` ("cpu": gloo, "cuda": NCCL; the same call either way); ``order``: the
    ranks in slot order (trainer/placement.py), None for the identity."""
    if order is None or order == list(range(shape.world)):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (shape.pp, shape.dp, shape.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if sorted(order) != list(range(shape.world)):
        raise ValueError(f"rank order {order} is not a permutation of {shape.world} ranks")
    return DeviceMesh(device_type, torch.tensor(order).view(shape.pp, shape.dp, shape.tp),
                      mesh_dim_names=("pp", "dp", "tp"))


def dp_coordinate(shape: MeshShape, slot: int) -> int:
    """The dp index of the rank at ``slot`` (its rank, in the fixed layout): the data shard
    it reads. The tp ranks of one dp group (the consecutive slots ``dp_index * tp ...`` of a
    stage) and the stages of one pipeline read the same batch."""
    return coordinates(slot, dp=shape.dp, tp=shape.tp, pp=shape.pp)["dp"]


def pp_coordinate(shape: MeshShape, slot: int) -> int:
    """The pipeline stage of the rank at ``slot``."""
    return coordinates(slot, dp=shape.dp, tp=shape.tp, pp=shape.pp)["pp"]

