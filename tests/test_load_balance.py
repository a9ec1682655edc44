"""Heavy-hitter replication balances cache reads (paper §4.3): on a Zipf-skewed
LooGLE-like workload over 8 instances the CV of per-instance reads is below 15% with
replication and clearly below the CV of hash placement alone."""

from dataclasses import replace

from tokenlake.tools.walkthrough import WorkloadConfig, cv, run

WORKLOAD = replace(
    WorkloadConfig(), num_documents=30, document_tokens=12_000, num_requests=240, concurrency=16
)


def test_replication_brings_cv_below_15_percent_and_below_hash_placement():
    without = run(8, replication=False, workload=WORKLOAD)
    with_rep = run(8, replication=True, workload=WORKLOAD)
    print(f"CV without replication {without.mean_cv:.1%}, with {with_rep.mean_cv:.1%}")
    assert with_rep.replications > 0
    assert with_rep.mean_cv < 0.15
    assert with_rep.mean_cv < 0.6 * without.mean_cv
    # Replication changes where reads go, never what is cached or hit.
    assert with_rep.hit_rate == without.hit_rate
    assert sum(with_rep.reads.values()) == sum(without.reads.values())


def test_cv_of_whole_run_reads():
    with_rep = run(8, replication=True, workload=WORKLOAD)
    assert cv(list(with_rep.reads.values())) < 0.15


def test_cv_helper():
    assert cv([1.0, 1.0, 1.0]) == 0.0
    assert cv([0.0, 0.0]) == 0.0
    assert abs(cv([1.0, 3.0]) - 0.5) < 1e-12
