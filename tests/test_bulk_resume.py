"""Bulk jobs that survive their RQ worker: an analysis job whose RQ worker and work horse are
SIGKILLed mid-map is retried by another RQ worker within a minute, resumes from its journal
(finished chunks kept, requests in flight followed again) and returns what an undisturbed
run returns, with each chunk generated once. Real Redis, real `conveyor bulk worker`
processes, a conveyor worker serving the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleet_fixtures import KEEP_SERVED_REQUESTS, MODEL
from rq import Worker
from rq.job import Job
from rq.serializers import JSONSerializer
from test_bulk_analyze import FAST, document, tokenizer_of
from waiting import eventually

from producer.bulk import analyze_document, bulk_queue, enqueue_analyze
from producer.bulk.chunking import count_chunks
from producer.bulk.journal import journal_key, watch_id_for
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, decode_output

KEYS = Keys()
ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Name the places."
# 200 chunks of 24 tokens, answers of 4 tokens: a job of a few seconds here.
OPTIONS = {"chunk_tokens": 24, "overlap_tokens": 0, "max_tokens": 4}
# The bound the issue names: the job runs again this soon after its worker died (seconds).
RESUMED_WITHIN_S = 60


def journal_fields(r, job_id: str) -> dict[str, bytes]:
    return {k.decode(): v for k, v in r.hgetall(journal_key(job_id)).items()}


def count(fields: dict[str, bytes], prefix: str) -> int:
    return sum(1 for k in fields if k.startswith(prefix))


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_job_whose_rq_worker_and_work_horse_die_resumes_on_another_worker(
        redis_url, redis_client, tiny_llama, start_worker):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    tok = tokenizer_of(tiny_llama)
    text = document(tok, 200 * 24, seed=11)
    n = count_chunks(len(tok.encode(text, add_special_tokens=False).ids), 24, 0)
    assert n >= 200

    # The undisturbed run, in this process (no RQ, so no journal): the expected result.
    expected = analyze_document(text, INSTRUCTION, model=MODEL, redis_url=redis_url,
                                model_wait_timeout=0, **OPTIONS)
    lane = KEYS.requests(MODEL, "batch")
    sent_before = redis_client.xlen(lane)

    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    rq_workers = [subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "bulk", "worker", "--redis", redis_url],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(2)]
    try:
        queue = bulk_queue(redis_url)
        eventually(lambda: len(Worker.all(queue=queue)) == 2, "both RQ workers to listen")
        job = enqueue_analyze(queue, text, INSTRUCTION, model=MODEL, **OPTIONS)
        eventually(lambda: count(journal_fields(redis_client, job.id), "done:") >= n // 10,
                   "a tenth of the chunks to be done", poll_s=0.005)
        job.refresh()
        [victim] = [w for w in Worker.all(queue=queue) if w.name == job.worker_name]
        [rq_pid] = [p.pid for p in rq_workers if p.pid == victim.pid]
        [horse] = children(rq_pid)
        for pid in (rq_pid, horse):
            os.kill(pid, signal.SIGSTOP)  # the job frozen where it is, at any machine speed
        # The precondition: the job really was mid-map in that worker's work horse, with
        # chunks done and requests in flight.
        frozen = journal_fields(redis_client, job.id)
        done, in_flight = count(frozen, "done:"), count(frozen, "sent:")
        assert job.get_status() == "started" and job.get_meta()["stage"] == "map"
        assert n // 10 <= done < n and in_flight > 0, (done, in_flight)
        for pid in (rq_pid, horse):
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert rq_workers[[p.pid for p in rq_workers].index(rq_pid)].wait(10) == -9
        eventually(lambda: not alive(horse), "the work horse to die")

        eventually(lambda: journal_fields(redis_client, job.id).get("runs") == b"2",
                   f"the job to run again within {RESUMED_WITHIN_S} s",
                   patience_s=RESUMED_WITHIN_S - (time.monotonic() - killed_at), poll_s=0.1)
        job = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
        eventually(lambda: job.get_status(refresh=True) in ("finished", "failed"),
                   "the resumed job to end", patience_s=120)
    finally:
        for proc in rq_workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    assert job.get_status() == "finished", job.latest_result().exc_string
    result = job.return_value()
    # What the undisturbed run answered, chunk by chunk and reduce by reduce.
    assert result["answer"] == expected["answer"]
    assert [c["text"] for c in result["chunks"]] == [c["text"] for c in expected["chunks"]]
    # (The same tokens; how many the fleet's prefix cache served differs between runs.)
    def tokens(u: dict) -> tuple[int, int]:
        return u["prompt_tokens"], u["completion_tokens"]

    assert [tokens(c["usage"]) for c in result["chunks"]] == [
        tokens(c["usage"]) for c in expected["chunks"]]
    assert [(r["level"], r["group"], r["inputs"], r["text"])
            for r in result["reduce"]["requests"]] == [
        (r["level"], r["group"], r["inputs"], r["text"]) for r in expected["reduce"]["requests"]]
    assert tokens(result["usage"]) == tokens(expected["usage"])
    # Resumed: the second run kept what the first had finished and followed what it had in
    # flight ...
    runs = result["runs"]
    assert runs["count"] == 2 and runs["results_reused"] == done
    assert runs["requests_reattached"] == in_flight and runs["requests_lost"] == 0
    # ... so each chunk and reduce was generated once: one request each, counted by the
    # journal and by the lane (its entries are kept), none cancelled.
    requests = len(result["chunks"]) + len(result["reduce"]["requests"])
    assert runs["requests_sent"] == requests
    assert all(c["attempts"] == 1 and len(c["request_ids"]) == 1 for c in result["chunks"])
    sent = [GenerationRequest.decode(f[FIELD]) for _, f in redis_client.xrange(lane)]
    sent = sent[sent_before:]
    assert len(sent) == requests
    assert {r.request_id for r in sent} == {
        rid for c in result["chunks"] + result["reduce"]["requests"] for rid in c["request_ids"]}
    # Every request carried the job's watch, which the retry kept alive.
    assert {r.watch for r in sent} == {watch_id_for(job.id)}
    for r in sent:
        [final] = [e for e in (decode_output(f[FIELD]) for _, f in
                               redis_client.xrange(KEYS.output(r.request_id)))
                   if isinstance(e, FinalEntry)]
        assert final.finish_reason in ("stop", "length")
