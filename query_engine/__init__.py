"""Query engine: one process per instance that owns the instance's segment slab and
answers query tasks with partial attention ``(o, lse)`` (:mod:`query_engine.engine`).

:func:`main` is the process entry point the launchers in :mod:`tokenlake.deploy` start.
"""

from query_engine.engine import QueryEngine
from tokenlake.dataplane.engine import run_engine

__all__ = ["QueryEngine", "main"]


def main(spec_bytes: bytes, conn) -> None:
    """Runs one query engine process (a ``multiprocessing`` target; see
    :func:`tokenlake.dataplane.engine.run_engine` for the handshake over ``conn``)."""
    run_engine(QueryEngine, spec_bytes, conn)
