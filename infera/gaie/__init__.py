"""Infera's Gateway API Inference Extension endpoint picker (``python -m infera.gaie``).

An Envoy ext_proc server that picks each request's worker with the server's own routing stack
(``infera.server.routing_stack``: same discovery, KV events, policy and topology rule) and tells
Envoy where to send it (``x-gateway-destination-endpoint``). See ``ext_proc`` for the exchange,
``envoy_config`` for the bootstrap it prints.
"""
