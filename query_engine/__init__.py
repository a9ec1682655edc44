"""Query engine: one process per instance that owns the instance's segment slab and
answers query tasks with partial attention ``(o, lse)``.

Not built yet: it arrives with the data plane (issue #3). Its inputs are already
defined by the control plane: :class:`tokenlake.plans.QueryPlan` and
:class:`tokenlake.plans.QueryTask`.
"""
