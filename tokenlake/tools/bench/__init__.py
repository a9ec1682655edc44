"""The benchmarks behind ``tokenlake bench ...``: each module measures one thing, baseline
and TokenLake alternately in one run, and prints or writes JSON (docs/benchmarks.md)."""
