"""The `conveyor` command: one home for every verb.

``command`` builds the parser and dispatches; each ``*_verbs`` module adds its verbs and runs
them: ``client_verbs`` (submit, tail, cancel), ``bulk_verbs`` (analyze, batch files),
``gateway_verb``, ``redis_verbs`` (the embedded Redis, ACL users, functions), ``top``
(the fleet view), ``worker_verbs`` (worker, make-model, generate, demo) with ``demo``.
Building the parser loads no torch: verbs that only talk to Redis start fast.
"""

from worker.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
