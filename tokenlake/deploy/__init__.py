"""Launchers: the pool's engines on this machine (:mod:`tokenlake.deploy.local`) or on a
Ray cluster (:mod:`tokenlake.deploy.ray`)."""
