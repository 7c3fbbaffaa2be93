"""experiments.run_id: an interleaved experiment names its run (it was a trial lease owner's
"run:<id>" parsed back), so a restarting daemon finds the experiments its runs left behind

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain column and no foreign key: SQLite adds it in place, where a constraint would
    # make the batch mode copy and drop the table, and dropping it cascades (the database
    # enforces foreign keys) to every arm and trial of every experiment.
    op.add_column("experiments", sa.Column("run_id", sa.Integer(), nullable=True))
    op.create_index("ix_experiments_run_id", "experiments", ["run_id"])
    # The link the old schema kept: an interleaved run held its trials as "run:<id>".
    trials = sa.table("trials", sa.column("experiment_id", sa.Integer),
                      sa.column("lease_owner", sa.String))
    experiments = sa.table("experiments", sa.column("id", sa.Integer),
                           sa.column("run_id", sa.Integer))
    conn = op.get_bind()
    links = {exp: int(owner.removeprefix("run:")) for exp, owner in conn.execute(
        sa.select(trials.c.experiment_id, trials.c.lease_owner)
        .where(trials.c.lease_owner.like("run:%")))
        if owner.removeprefix("run:").isdigit()}
    for exp, run in links.items():
        conn.execute(experiments.update().where(experiments.c.id == exp).values(run_id=run))


def downgrade() -> None:
    op.drop_index("ix_experiments_run_id", table_name="experiments")
    op.drop_column("experiments", "run_id")  # in place too (SQLite >= 3.35), for the same reason
