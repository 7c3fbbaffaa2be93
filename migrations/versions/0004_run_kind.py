"""runs.kind: plain jobs resume after a preemption; experiment jobs and forked trials do not

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


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("kind")
