"""Evaluation harness: workloads, the cluster simulator, experiments and reports.

Not built yet (issue #6). The control-plane walk-through in
:mod:`tokenlake.walkthrough` is the first workload-driven run.
"""
