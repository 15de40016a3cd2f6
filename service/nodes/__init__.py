"""The node registry: the worker nodes the service knows (heartbeats, capacity), served at /v1/workers.

Named `nodes` apart from the top-level `workers/` package, which is the node process itself.
"""
