"""Data-parallel serving: N engine replicas on Ray behind one OpenAI endpoint, routed by prefix.

Only `replica` and `client` import Ray; the routing policy, the metrics merge and the CLI arguments do not,
so the single-process server and the router simulation never need it.
"""
