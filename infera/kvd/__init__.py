"""infera.kvd: the per-host tiered KV-cache daemon (L2 host RAM + shared arena, L3 tablespace).

Run it with ``python -m infera.kvd``; talk to it with ``infera.kvd.client``.
"""
