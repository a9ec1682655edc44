"""The attention math: partial attention ``(o, lse)`` over pool segments and its exact
log-sum-exp merge (:mod:`~tokenlake.kernels.attention`), its CPU, paged (FlashInfer) and
slab forms, the backend choice, and the native C++ kernels' bindings
(:mod:`~tokenlake.kernels.native`). Pure functions on tensors: nothing here opens a socket
or a buffer.
"""
