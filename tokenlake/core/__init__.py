"""The control plane, pure Python (no torch, no zmq, no process): segments and their
keys, the global prefix tree, slots, the cache pool with placement, replication and
eviction, dispatch, the cost model, plans, typed errors and configuration.

:class:`tokenlake.core.control.ControlPlane` is the facade the scheduler and the
launchers use. ``tests/test_layering.py`` checks that nothing here imports a layer above.
"""
