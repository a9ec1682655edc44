"""The ``tokenlake`` command and what it runs: the demo, the walk-through, benchmarks
and profilers. Nothing below this layer imports it."""
