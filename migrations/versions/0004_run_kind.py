"""runs.kind and runs.node: plain jobs resume after a preemption (experiment jobs and forked
trials do not), and a restarting daemon touches only its own node's runs

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=False,
                                   server_default="job"))
        batch.add_column(sa.Column("node", sa.String(length=255), nullable=False,
                                   server_default=""))
        batch.create_index("ix_runs_node", ["node"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_node")
        batch.drop_column("node")
        batch.drop_column("kind")
