"""Transfer engine: one process per instance that executes transfer plans (puts of new
KV, whole-segment replication and migration, frees) (:mod:`transfer_engine.engine`).

:func:`main` is the process entry point the launchers in :mod:`tokenlake.deploy` start.
"""

from tokenlake.dataplane.engine import run_engine
from transfer_engine.engine import TransferEngine

__all__ = ["TransferEngine", "main"]


def main(spec_bytes: bytes, conn) -> None:
    """Runs one transfer engine process (a ``multiprocessing`` target; see
    :func:`tokenlake.dataplane.engine.run_engine` for the handshake over ``conn``)."""
    run_engine(TransferEngine, spec_bytes, conn)
