"""Schedulers: the goodput DP scheduler and the baseline policies on one interface.

Not built yet (issue #5). They will call :meth:`tokenlake.control.ControlPlane.gen_plans`
with their batches and degrees of parallelism.
"""
