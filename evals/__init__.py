"""Evaluation harness (issue #6): workloads (:mod:`evals.workloads`), the cluster
simulator (:mod:`evals.sim`), experiments and reports.

The control-plane walk-through in :mod:`tokenlake.tools.walkthrough` is the smallest
workload-driven run.
"""
