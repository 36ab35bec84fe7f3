"""Bulk jobs that survive their RQ worker: an analysis job whose RQ worker and work horse are
SIGKILLed mid-map is retried by another RQ worker within a minute, resumes from its journal
(finished chunks kept, requests in flight followed again) and returns what an undisturbed
run returns, with each chunk generated once. Real Redis, real `conveyor bulk worker`
processes, a conveyor worker serving the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet_fixtures import KEEP_SERVED_REQUESTS, MODEL, sent_requests
from rq import Worker
from rq.job import Job, _current_job
from rq.serializers import JSONSerializer
from test_bulk_analyze import FAST, bulk, document, tokenizer_of
from waiting import eventually

from producer.bulk import analyze_document, bulk_queue, enqueue_analyze
from producer.bulk.chunking import count_chunks
from producer.bulk.defaults import JOURNAL_KEEP_DONE_S
from producer.bulk.journal import (
    JobJournal,
    Resumed,
    Sent,
    Superseded,
    journal_key,
    watch_id_for,
)
from producer.bulk.requests import RequestRunner, RetryPolicy, Work
from producer.client.client import Client
from producer.client.connection import connect
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, decode_output

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


def unplaced(fields: dict[str, bytes]) -> int:
    """Requests of a journal sent without their lane entry id recorded yet."""
    return sum(1 for k, v in fields.items()
               if k.startswith("sent:") and json.loads(v)["entry_id"] is None)


# Freezes tried until one lands outside a submit (each submit is a few milliseconds).
FREEZE_TRIES = 200


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_job_whose_rq_worker_and_work_horse_die_resumes_on_another_worker(
        redis_url, redis_client, tiny_llama, start_worker, capsys):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    tok = tokenizer_of(tiny_llama)
    text = document(tok, 200 * 24, seed=11)
    n = count_chunks(len(tok.encode(text, add_special_tokens=False).ids), 24, 0)
    assert n >= 200

    # The undisturbed run, in this process (no RQ, so no journal): the expected result.
    expected = analyze_document(text, INSTRUCTION, model=MODEL, redis_url=redis_url,
                                model_wait_timeout=0, **OPTIONS)
    # (the batch lane, and the workers' affinity lanes of it)
    sent_before = len(sent_requests(redis_client, MODEL, "batch"))

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
        # The job frozen where it is, at any machine speed; but not between a batch's
        # XADDs and the journal's record of their entry ids (a run that dies there has
        # requests the fleet may never have seen: it cancels and resends them, a case of
        # its own below), so thawed a moment and frozen again when it was there.
        for _ in range(FREEZE_TRIES):
            for pid in (rq_pid, horse):
                os.kill(pid, signal.SIGSTOP)
            frozen = journal_fields(redis_client, job.id)
            if not unplaced(frozen):
                break
            for pid in (rq_pid, horse):
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        assert not unplaced(frozen), "the job was always frozen mid-submit"
        # The precondition: the job really was mid-map in that worker's work horse, with
        # chunks done and requests in flight.
        done, in_flight = count(frozen, "done:"), count(frozen, "sent:")
        assert job.get_status() == "started" and job.get_meta()["stage"] == "map"
        assert n // 10 <= done < n and in_flight > 0, (done, in_flight)
        # SIGKILL the RQ worker; the kernel SIGKILLs its work horse with it (RQ leaves a
        # horse running when its worker dies; a BulkWorker's asks to die with it).
        os.kill(rq_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert rq_workers[[p.pid for p in rq_workers].index(rq_pid)].wait(10) == -9
        eventually(lambda: not running(horse), "the work horse to die with its worker")

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
    sent = sent_requests(redis_client, MODEL, "batch")[sent_before:]
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
    # `conveyor bulk status` tells the job resumed, and how far it got.
    assert bulk("status", job.id, "--redis", redis_url) == 0
    out = capsys.readouterr().out
    assert f"chunks {n}/{n}" in out and "run 2 (resumed)" in out and "finished" in out


def test_a_run_follows_the_requests_its_journal_holds_and_resends_the_lost_ones(
        redis_url, redis_client, start_worker):
    start_worker(**FAST)
    journal = JobJournal(redis_client, "job-1")
    assert journal.begin("plan-a").runs == 1
    lane = KEYS.requests(MODEL, "batch")
    sampling = {"max_tokens": 4, "temperature": 0.0}
    with Client(redis_url) as client:
        # What a first run left: a request that finished while no run followed it, one that
        # was cancelled meanwhile (its watch lapsed), one a failover lost (delivered and
        # acknowledged, no output) and one whose XADD never happened (no entry id).
        finished = client.submit([5, 6, 7], model=MODEL, lane="batch", **sampling)
        # (Long enough that the cancel comes first.)
        cancelled = client.submit([5, 6, 8], model=MODEL, lane="batch", max_tokens=1500,
                                  ignore_eos=True)
        client.cancel(cancelled)
        for rid in (finished, cancelled):
            eventually(lambda rid=rid: final_of(redis_client, rid), "the request to end")
        assert final_of(redis_client, cancelled).finish_reason == "cancelled"
        # Acknowledged too (a worker acknowledges a final with its next round trip): the
        # lost one below stands for an entry delivered, acknowledged and without output.
        eventually(lambda: redis_client.xpending(lane, "workers")["pending"] == 0,
                   "both acknowledged")
        [finished_entry, cancelled_entry] = [e for e, _ in redis_client.xrange(lane)]
        records = {
            "c0": Sent(finished, lane, finished_entry.decode(), [finished]),
            "c1": Sent(cancelled, lane, cancelled_entry.decode(), [cancelled]),
            "c2": Sent("lost-1", lane, finished_entry.decode(), ["lost-1"]),
            "c3": Sent("never-sent-1", lane, None, ["never-sent-1"]),
        }
        journal.sending(records)
        resumed = journal.begin("plan-a")
        assert resumed.runs == 2 and resumed.sent == records and not resumed.done
        prompts = {"c0": [5, 6, 7], "c1": [5, 6, 8], "c2": [5, 6, 9], "c3": [5, 6, 10]}
        runner = RequestRunner(client, lane="batch", journal=journal,
                               policy=RetryPolicy(request_timeout=60, backoff_base=0))
        outcomes = {o.key: o for o in runner.run(
            [Work(k, p, MODEL, sampling) for k, p in prompts.items()], attach=resumed.sent)}

    assert all(o.ok for o in outcomes.values()), outcomes
    assert runner.reattached == 4 and runner.lost == 2
    # The finished one is read from its stream, not sent again.
    assert outcomes["c0"].request_ids == [finished] and outcomes["c0"].attempts == 1
    assert outcomes["c0"].completion.token_ids == client_tokens(redis_client, finished)
    # The others are sent again under new ids, once: the cancelled one (not this job's
    # cancel), the lost one (its look found it held by nothing) and the one the fleet never
    # saw (no entry id, no output), which is also cancelled in case its XADD did land.
    for key, first in (("c1", cancelled), ("c2", "lost-1"), ("c3", "never-sent-1")):
        ids = outcomes[key].request_ids
        assert ids[0] == first and len(ids) == 2 == outcomes[key].attempts
    assert redis_client.exists(KEYS.cancelled("never-sent-1"))
    # Every new request is in the journal, counted, before and after its XADD.
    assert journal.submitted() == len(records) + runner.submitted and runner.submitted >= 3
    after = JobJournal(redis_client, "job-1").begin("plan-a")
    for key in ("c1", "c2", "c3"):
        assert after.sent[key].request_id == outcomes[key].request_ids[-1]
        assert after.sent[key].entry_id is not None
    # Another plan under the same job id starts afresh.
    assert JobJournal(redis_client, "job-1").begin("plan-b") == Resumed(1, {}, {})


def final_of(r, request_id: str) -> FinalEntry | None:
    entries = [decode_output(f[FIELD]) for _, f in r.xrange(KEYS.output(request_id))]
    return next((e for e in entries if isinstance(e, FinalEntry)), None)


def client_tokens(r, request_id: str) -> list[int]:
    entries = [decode_output(f[FIELD]) for _, f in r.xrange(KEYS.output(request_id))]
    return [t for e in entries if not isinstance(e, FinalEntry) for t in e.token_ids]


def test_the_journal_keeps_results_and_requests_in_flight_on_each_redis(each_redis):
    r = connect(each_redis.url)
    r.flushall()
    journal = JobJournal(r, "job-2", ttl_s=600)
    assert journal.begin("plan") == Resumed(1, {}, {})
    sent = {"c0": Sent("a", "lane", None, ["a"]), "c1": Sent("b", "lane", None, ["b"])}
    journal.sending(sent)
    journal.placed({"c0": Sent("a", "lane", "1-0", ["a"])})
    journal.done("c1", {"text": "x", "token_ids": [1, 2]})
    resumed = journal.begin("plan")
    assert resumed.runs == 2 and journal.submitted() == 2
    assert resumed.sent == {"c0": Sent("a", "lane", "1-0", ["a"])}
    assert resumed.done == {"c1": {"text": "x", "token_ids": [1, 2]}}
    assert 0 < r.ttl(journal_key("job-2")) <= 600
    journal.finish()  # the job returned: kept a short while only
    assert 0 < r.ttl(journal_key("job-2")) <= JOURNAL_KEEP_DONE_S
    # Each run of one job keeps one watch; other jobs keep others.
    assert watch_id_for("job-2") == watch_id_for("job-2") != watch_id_for("job-3")
    assert KEYS.watch(watch_id_for("x" * 128))  # a valid watch id for the longest job id
    # Only the newest run writes: an older one still going stops at its next write.
    old, new = JobJournal(r, "job-4"), JobJournal(r, "job-4")
    old.begin("plan")
    assert new.begin("plan").runs == 2
    with pytest.raises(Superseded, match="run 1 of the job was superseded by run 2"):
        old.done("c0", {"text": "late"})
    with pytest.raises(Superseded):
        old.sending({"c1": Sent("z", "lane")})
    new.done("c0", {"text": "x"})
    assert JobJournal(r, "job-4").begin("plan").done == {"c0": {"text": "x"}}
    r.close()


def test_a_rerun_reuses_every_journaled_result_and_makes_only_what_is_missing(
        redis_url, redis_client, tiny_llama, start_worker):
    """The reduce resumes as the map does: a run of a job whose first run finished sends
    nothing; with one reduce result gone from the journal, it sends that one alone."""
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    text = document(tokenizer_of(tiny_llama), 12 * 24, seed=5)
    job = enqueue_analyze(bulk_queue(redis_url), text, INSTRUCTION, model=MODEL, **OPTIONS)

    def run() -> dict:
        # The job's function in this process, with the job current as RQ's work horse sets
        # it (rq.job._current_job, what get_current_job reads).
        token = _current_job.set(Job.fetch(job.id, connection=redis_client,
                                           serializer=JSONSerializer))
        try:
            return analyze_document(**job.kwargs)
        finally:
            _current_job.reset(token)

    first = run()
    reduces = first["reduce"]["requests"]
    assert first["runs"]["count"] == 1 and len(reduces) >= 1
    assert first["runs"]["requests_sent"] == len(first["chunks"]) + len(reduces)
    again = run()
    # (requests_sent counts over every run: this one sent none.)
    assert again["runs"]["count"] == 2
    assert again["runs"]["requests_sent"] == first["runs"]["requests_sent"]
    last = reduces[-1]
    assert redis_client.hdel(journal_key(job.id), f"done:r{last['level']}.{last['group']}")
    third = run()
    assert third["runs"]["requests_sent"] == first["runs"]["requests_sent"] + 1
    assert third["runs"]["results_reused"] == len(first["chunks"]) + len(reduces) - 1
    for result in (again, third):
        assert result["answer"] == first["answer"] and result["chunks"] == first["chunks"]
        assert [r["text"] for r in result["reduce"]["requests"]] == [r["text"] for r in reduces]
