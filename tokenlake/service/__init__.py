"""The pool as a service: the control plane served on a port, and its remote clients.

:class:`~tokenlake.service.server.ControlServer` serves one launcher's control plane
(``tokenlake serve``); :func:`~tokenlake.service.remote.connect` (also
``tokenlake.connect``) gives another process a
:class:`~tokenlake.service.remote.RemoteControlPlane` with the same calls. The layer sits
above the launchers and below the evaluations (docs/design.md §2); the remote client
itself imports only the core and the data plane.
"""
