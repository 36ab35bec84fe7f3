"""Moving KV between workers: the prefill → decode handoff and fleet-wide prefix sharing.

The stages of a handed-on request, in order:

1. **Prefill worker** (``--role prefill``): computes the prompt like any request; once the
   first token is out, its engine loop takes the request out of the engine with its KV
   (``engine_kv.export_kv``) and publishes the token.
2. **The tier** (kvstore/tier): the publisher writes that KV under the request id
   (``handoff.HandOnWriter``), checked later against the reader's model fingerprint and
   layout (``engine_kv.kv_layout``).
3. **The handoff entry**: in the same step, in one owner-checked script, the request's
   message goes to ``{ns}:handoff:{model}:{lane}`` and its lane entry is acknowledged.
4. **Decode worker** (``--role decode``, or ``both``): its intake reads the handoff streams
   like lanes, resumes after the published tokens, fetches the KV (``handoff.HandoffReader``),
   and its engine loop admits the request with it (``engine_kv.add_with_kv``): token k is
   computed next, the prompt never again.

``prefix_share`` puts full prompt blocks in the tier by chain hash
(``engine_kv.export_prefix_blocks``) and reads them back for any worker's request that
shares the prefix. A missing, corrupt or unplaceable transfer is recomputed, never an
error. The messages these stages hand between threads are in worker/fleet/messages.py.
"""
