"""Alembic environment: migrates the URL given by ``traind.daemon.db.migrate``."""

from __future__ import annotations

from alembic import context

from traind.daemon.db.engine import make_engine
from traind.daemon.db.models import Base

target_metadata = Base.metadata
url = context.config.get_main_option("sqlalchemy.url")
assert url, "alembic_config() sets sqlalchemy.url"

if context.is_offline_mode():
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = make_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=url.startswith("sqlite"))
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()
