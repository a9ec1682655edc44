"""The data plane: how bytes move between the control plane, the engines and the compute
engines. The wire format and its messages, shared buffers (shared memory on CPU, CUDA IPC
on GPU) and the doorbells between processes, authentication and grants, and the client a
compute engine embeds.

The engines that serve it live in :mod:`tokenlake.engines`, the attention math in
:mod:`tokenlake.kernels`; neither is imported from here.
"""
