"""Transfer engine: one process per instance that executes transfer plans (puts of new
KV, whole-segment replication and migration, frees).

Not built yet: it arrives with the data plane (issue #3). Its inputs are already
defined by the control plane: :class:`tokenlake.plans.TransferPlan` and
:class:`tokenlake.pool.Replication`.
"""
