"""The data plane: the wire format, shared buffers, partial attention and its merge, the
client a compute engine embeds, and the event loop both engine kinds share.

The engine processes themselves live in the top-level ``query_engine`` and
``transfer_engine`` packages, which import this one (never the other way round).
"""
