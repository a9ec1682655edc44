"""Discrete-event, iteration-level cluster simulator (issue #6; docs/simulator.md).

It runs the real TokenLake control plane and the real scheduling policies; only the
time of compute and data movement is modelled. Entry point::

    from evals.sim.systems import simulate
    result = simulate(requests, "tokenlake", SimConfig(instances=8))

Importing this package is cheap (no numpy); the command line (``tokenlake sim``,
``tokenlake bench sim``) lives in :mod:`tokenlake.tools.cli.eval` and
:mod:`tokenlake.tools.cli.bench`.
"""
