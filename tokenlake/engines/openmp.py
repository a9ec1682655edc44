"""The OpenMP settings of the processes TokenLake starts (a module of its own: the command
line and Ray's actors read it without loading torch)."""

#: The OpenMP settings of the processes TokenLake starts (engines, the command line, Ray's
#: compute actors) unless set already: torch's idle OpenMP workers then sleep after a
#: short spin instead of spinning on, which on small machines takes the CPU from the
#: other engines (``tokenlake.tools.cli.main`` says what was measured). They take effect
#: only before a process loads OpenMP.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000"}
