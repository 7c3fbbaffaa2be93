"""Where a rank sits on the device mesh: one definition for the trainer (which builds the mesh)
and the daemon and web (which draw it), so neither side re-derives the layout.

The layout is row-major over ``("pp", "dp", "tp")`` (torchtitan's order; trainer/mesh.py says
why): tp varies fastest, so a tp group is consecutive ranks, and pp slowest.
"""

from __future__ import annotations

# The mesh dimensions a communication figure is labelled with (``mesh_dim``): data, tensor
# and pipeline parallel; "world" for a probe over every rank of a mesh that is not all dp.
MESH_DIMS = ("dp", "tp", "pp")


def coordinates(rank: int, *, dp: int, tp: int, pp: int) -> dict[str, int]:
    """The ``{"dp", "tp", "pp"}`` coordinate of ``rank`` on a ``dp x tp x pp`` mesh."""
    assert 0 <= rank < dp * tp * pp, f"rank {rank} is not on a {dp}x{tp}x{pp} mesh"
    return {"dp": rank // tp % dp, "tp": rank % tp, "pp": rank // (tp * dp)}
