"""Tensor parallel over the mesh's ``tp`` dimension, with PyTorch's own engine
(``torch.distributed.tensor.parallel``): the plan below is torchtitan's Llama plan
(``parallelize_llama.apply_tp``) for this model's module names.

Per block: q, k, v and the SwiGLU's gate and up are column-parallel (each tp rank computes its
share of the heads and of the hidden units, no communication; with grouped-query attention k and
v are narrower, and a rank's n_kv_heads / tp kv heads are exactly the ones its n_heads / tp query
heads read, so the same styles serve), the attention's ``proj`` and the
MLP's ``down`` are row-parallel (each rank's partial sums are reduce-scattered). Between them the
residual stream is sharded on the sequence (sequence parallel): the norms and the residual adds
run on ``T / tp`` tokens per rank, and each branch all-gathers its input once. The token
embedding is vocab-parallel (rows sharded, a masked lookup and one reduce-scatter) and the head
column-parallel on the vocabulary; the logits are all-gathered, so the loss is the plain
cross-entropy of ``GPT.forward`` (loss parallel is a later option).

Every parameter ends up a DTensor on the tp mesh (sharded, or replicated for the norms), which
is what makes ``clip_grad_norm_`` global across tp shards: the norm of a sharded gradient is a
partial sum that DTensor all-reduces, a replicated one counts once.

fp8 (torchao float8 training, either recipe) converts the Linear layers first and the plain
styles above then shard the Float8Linear modules, as torchtitan does for the rowwise recipe:
each rank casts its shard's matmul inputs to fp8 (a tensorwise scale's amax is all-reduced
over the shards by DTensor), and the all-gathers and reduce-scatters carry the autocast dtype.
torchao's Float8 styles, which all-gather in fp8 under the tensorwise recipe, are not used:
gloo cannot move float8 tensors ("Invalid scalar type", torch 2.13), so they would be a
CUDA-only path that nothing here runs; that saving is for a session with two GPUs.

The weights are initialised in full on every rank from ``job.seed`` (as one rank would) and then
sharded, so a tp run starts from exactly the one-rank model.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from traind.errors import FieldErrors
from traind.trainer.factory import UserModel

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


def block_plan() -> dict[str, ParallelStyle]:
    """The plan of one ``Block``: module path -> style. The residual stream enters and
    leaves sharded on the sequence (``Shard(1)`` of ``(B, T, C)``)."""
    return {
        "attn_norm": SequenceParallel(),
        # x (Shard(1)) is all-gathered once for q, k and v; cos and sin stay plain tensors
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                   desired_input_layouts=(Replicate(), None, None)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


class WaitedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` whose output waits for its collective: a plain tensor, not the
    ``AsyncCollectiveTensor`` the stock style returns. For the embedding, whose output is
    the first block's input: a compiled block (AOTAutograd, under inductor as under
    aot_eager) handed an ``AsyncCollectiveTensor`` returns its gradient as a plain tensor
    where the redistribute's backward needs a DTensor, and the first backward of every
    compiled tp job raised ``AttributeError: 'Tensor' object has no attribute
    '_local_tensor'`` (torch 2.13; eager blocks never saw it). Nothing runs between the
    lookup and the first block's use of it, so waiting here costs no overlap."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: Any, device_mesh: DeviceMesh) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def model_plan() -> dict[str, ParallelStyle]:
    """The plan of the modules around the blocks."""
    return {
        # a vocab-sharded lookup whose partial rows are reduce-scattered onto the sequence
        "tok_emb": WaitedRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # logits gathered whole (Replicate): GPT.forward's cross-entropy stays as it is
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


# The plan's words for PyTorch's two plain styles (a factory's plan may name either, or give
# any ParallelStyle itself)
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def user_plan(model: UserModel) -> dict[str, ParallelStyle]:
    """A factory model's ``tp_plan`` as PyTorch styles, every path checked against the module;
    a ``FieldErrors`` at its field (``model.factory`` or ``model.hf``) naming the first entry
    that cannot be used."""
    names = [name for name, _ in model.inner.named_modules()]
    plan: dict[str, ParallelStyle] = {}
    for path, style in model.tp_plan.items():
        where = f"tp_plan[{path!r}]"
        if isinstance(style, str) and style in STYLES:
            style = STYLES[style]()
        if not isinstance(style, ParallelStyle):
            raise FieldErrors.at(model.field, f"{where} is {style!r}: not 'colwise', "
                                 "'rowwise' nor a ParallelStyle")
        if not any(fnmatchcase(name, path) for name in names if name.count(".") ==
                   path.count(".")):
            raise FieldErrors.at(model.field, f"{where} names no module of "
                                 f"{type(model.inner).__name__}")
        plan[path] = style
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` (a ``GPT``, or a factory's model by its own plan) in place over
    ``tp_mesh``; the same module comes back. Call before the data-parallel wrap and before
    compiling (torchtitan's order)."""
    if isinstance(model, UserModel):
        parallelize_module(model.inner, tp_mesh, user_plan(model))
        return model
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("parallel.tp > 1 needs a GPT-like model with .blocks")
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan())
    parallelize_module(model, tp_mesh, model_plan())
    return model
