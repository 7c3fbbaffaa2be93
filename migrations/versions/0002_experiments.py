"""experiments, arms and trials (the A/B scheduler's queue)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("base_config", sa.JSON(), nullable=False),
        sa.Column("objective", sa.JSON(), nullable=False),
        sa.Column("budget", sa.JSON(), nullable=False),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("traind_version", sa.String(length=64), nullable=False),
        sa.Column("torch_version", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_experiments_state", "experiments", ["state"])
    op.create_table(
        "arms",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("overrides", sa.JSON(), nullable=False),
        sa.Column("is_baseline", sa.Boolean(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("experiment_id", "name", name="uq_arms_experiment_name"),
    )
    op.create_index("ix_arms_experiment_id", "arms", ["experiment_id"])
    op.create_table(
        "trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm_id", sa.Integer(), nullable=False),
        sa.Column("repeat", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["arm_id"], ["arms.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["experiment_id"], ["experiments.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    # What the claim query filters and orders by: state, then the lowest (priority, id).
    op.create_index("ix_trials_claim", "trials", ["state", "priority", "id"])
    op.create_index("ix_trials_experiment_id", "trials", ["experiment_id"])
    op.create_index("ix_trials_arm_id", "trials", ["arm_id"])


def downgrade() -> None:
    op.drop_index("ix_trials_arm_id", table_name="trials")
    op.drop_index("ix_trials_experiment_id", table_name="trials")
    op.drop_index("ix_trials_claim", table_name="trials")
    op.drop_table("trials")
    op.drop_index("ix_arms_experiment_id", table_name="arms")
    op.drop_table("arms")
    op.drop_index("ix_experiments_state", table_name="experiments")
    op.drop_table("experiments")
