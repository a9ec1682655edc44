"""Schedulers: the goodput DP scheduler and the baseline policies on one interface.

:mod:`scheduler.api` is the interface (snapshots in, decisions out, :func:`to_batches`
for :meth:`tokenlake.core.control.ControlPlane.gen_plans`); :mod:`scheduler.goodput` is the
paper's DP (§6.2); :mod:`scheduler.bench` times it. See docs/scheduling.md.
"""
