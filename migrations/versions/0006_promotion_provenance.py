"""promotions: what a promotion rests on (the config hash and versions of its target job and of
its evidence), and rows that sent no control message (seq null: nothing beat the baseline, the
run already had the setting, or the evidence came from another configuration)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = (("config_hash", sa.String(length=64)), ("versions", sa.JSON()),
           ("evidence_config_hash", sa.String(length=64)), ("evidence_versions", sa.JSON()))


def upgrade() -> None:
    # Plain nullable columns: SQLite adds them in place. Rows written before this revision
    # recorded none of it, and stay null (shown as "not recorded").
    for name, type_ in COLUMNS:
        op.add_column("promotions", sa.Column(name, type_, nullable=True))
    # Making seq nullable rebuilds the table on SQLite (batch mode: copy, drop, rename). Safe
    # here, unlike experiments in 0005: no foreign key points at promotions, so the drop
    # cascades nowhere; the index on run_id is rebuilt with it.
    with op.batch_alter_table("promotions") as batch:
        batch.alter_column("seq", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    # The old schema cannot hold a row without a message: those rows go (nothing was sent,
    # so no job ever saw them), the rest keep their numbers.
    op.execute("DELETE FROM promotions WHERE seq IS NULL")
    with op.batch_alter_table("promotions") as batch:
        batch.alter_column("seq", existing_type=sa.Integer(), nullable=False)
    for name, _ in reversed(COLUMNS):
        op.drop_column("promotions", name)  # in place (SQLite >= 3.35)
