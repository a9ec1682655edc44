"""The three engines of an instance (docs/design.md §1).

* :mod:`~tokenlake.engines.query`: the query engine, which owns an instance's segment
  slab and answers query tasks with partial attention;
* :mod:`~tokenlake.engines.transfer`: the transfer engine, which stores new KV, copies
  segments between instances and frees them;
* :mod:`~tokenlake.engines.compute`: the stateless compute engine, which holds weights
  only and runs the model over the pool.

The query and transfer engines share their event loop (:mod:`~tokenlake.engines.loop`),
their start-up spec (:mod:`~tokenlake.engines.spec`) and what they know of sessions,
doorbells and their owner. Nothing is imported here: every engine module needs torch.
"""
