"""Redis itself: the embedded redis-server (find the binary, configure, start, stop), the
server-side functions the clients and workers call, and ACL users limited to their keys.

``server`` is the entry point (``ensure_running``, ``start_ephemeral``); ``binary``,
``config``, ``process`` and ``ephemeral`` are its parts. Absolute imports throughout:
``import redis`` inside this package is the redis-py client, not this folder.
"""
