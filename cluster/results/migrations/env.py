"""Alembic environment of the result store.

Run programmatically (``cluster.results.store.migrate``): the caller passes an open connection in
``config.attributes["connection"]`` (inside its transaction and migration lock) and commits.
From the ``alembic`` command line (``alembic.ini``), the URL is ``-x db=URL``, else
``sqlalchemy.url``, else ``cluster.results.store.DEFAULT_DB_URL``.
"""
from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine

from cluster.results.store import DEFAULT_DB_URL, Base

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None and "connection" not in config.attributes:  # the alembic CLI
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    return (context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option("sqlalchemy.url")
            or DEFAULT_DB_URL)


def _configure(**kwargs) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_offline() -> None:
    url = _url()
    _configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"},
               render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():  # a no-op inside the caller's transaction
            context.run_migrations()
        return
    engine = create_engine(_url())
    try:
        with engine.connect() as conn:
            _configure(connection=conn, render_as_batch=conn.dialect.name == "sqlite")
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
