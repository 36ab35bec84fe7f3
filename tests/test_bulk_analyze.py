"""Long-document analysis through RQ: real Redis, a real RQ worker (burst mode, JSON
serializer), conveyor workers serving the tiny model (2,048-token context)."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import subprocess
import sys
import zlib
from dataclasses import asdict
from pathlib import Path

import pytest
import redis
from fleet_fixtures import KEEP_SERVED_REQUESTS, MODEL
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from tokenizers import Tokenizer
from waiting import eventually

from producer.bulk import analyze_document, bulk_queue, enqueue_analyze, job_timeout_for
from producer.bulk.analyze import AnalyzeOptions
from producer.bulk.chunking import count_chunks, group_to_fit, item_cap, split
from producer.bulk.defaults import REDUCE_INSTRUCTION
from producer.bulk.journal import Cancelled, JobJournal, Sent, Superseded, journal_key
from producer.bulk.prompts import Templates
from producer.bulk.queue import fleet_url_for, job_progress
from producer.bulk.requests import FailureKind, RetryPolicy, classify
from producer.bulk.workers import BulkSimpleWorker
from producer.client.client import Client
from producer.client.connection import connect
from producer.wire.completion import Completion, FinishReason, Usage
from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, decode_output
from worker.cli.bulk_verbs import describe_progress, run_bulk_cmd
from worker.cli.command import build_parser

KEYS = Keys()
ROOT = Path(__file__).resolve().parents[1]
JOB_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
WORDS = ("river stone bridge lantern harbour orchard meadow signal copper window garden "
         "ledger winter engine pocket thunder village market candle mirror").split()
# Worker settings: float32 is faster than the fixture's float64 and room for every chunk.
FAST = {"dtype": "float32", "num_kv_blocks": 1536, "max_num_seqs": 32}


# --- helpers ---------------------------------------------------------------------------------


def tokenizer_of(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def document(tokenizer: Tokenizer, min_tokens: int, seed: int = 0) -> str:
    """Plain sentences, at least ``min_tokens`` long with the model's tokenizer."""
    rng = random.Random(seed)
    sentences: list[str] = []
    estimate = 0
    while True:
        while estimate < min_tokens:
            sentence = " ".join(rng.choices(WORDS, k=rng.randint(6, 14))).capitalize() + "."
            sentences.append(sentence)
            estimate += len(tokenizer.encode(" " + sentence, add_special_tokens=False).ids)
        text = " ".join(sentences)
        if len(tokenizer.encode(text, add_special_tokens=False).ids) >= min_tokens:
            return text
        estimate = 0 if not sentences else estimate - 20


def run_burst(redis_url: str, name: str = "conveyor-bulk", **worker_options) -> None:
    """An RQ worker in this process, JSON serializer, until the queue is empty."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    connection = connect(redis_url)
    try:
        queue = Queue(name, connection=connection, serializer=JSONSerializer)
        BulkSimpleWorker([queue], connection=connection, serializer=JSONSerializer,
                         **worker_options).work(burst=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        connection.close()


def batch_requests(r) -> list[GenerationRequest]:
    return [GenerationRequest.decode(f[FIELD])
            for _, f in r.xrange(KEYS.requests(MODEL, "batch"))]


def total_usage(results: list[dict]) -> dict[str, int]:
    keys = ("prompt_tokens", "completion_tokens", "cached_tokens")
    return {k: sum(r["usage"][k] for r in results) for k in keys}


def bulk(*argv: str) -> int:
    """`conveyor bulk ARGV...` in this process (without main's logging set-up)."""
    return run_bulk_cmd(build_parser().parse_args(["bulk", *argv]))



# --- pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize("n,chunk,overlap", [(1, 5, 0), (5, 5, 0), (6, 5, 0), (20000, 1500, 100),
                                             (21430, 1500, 100), (100, 7, 6), (0, 3, 1)])
def test_chunks_cover_the_document_with_the_asked_overlap(n, chunk, overlap):
    spans = split(n, chunk, overlap)

    assert len(spans) == count_chunks(n, chunk, overlap)
    assert all(0 < s.num_tokens <= chunk for s in spans)
    if spans:
        assert spans[0].start == 0 and spans[-1].end == n
    for a, b in zip(spans, spans[1:], strict=False):
        assert b.start == a.end - overlap


def test_chunking_rejects_an_overlap_that_would_never_advance():
    with pytest.raises(ValueError, match="overlap_tokens"):
        split(100, 10, 10)


def test_grouping_fits_the_budget_and_at_least_halves_the_count():
    rng = random.Random(1)
    for _ in range(200):
        budget = rng.randint(4, 300)
        lengths = [rng.randint(1, item_cap(budget)) for _ in range(rng.randint(2, 40))]
        groups = group_to_fit(lengths, budget)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= budget for g in groups)
        assert len(groups) <= len(lengths) // 2 + 1 and len(groups) < len(lengths)


def test_failures_are_classified_as_invalid_or_transient():
    def done(reason):
        return Completion("r", [], "", FinishReason(reason), Usage(1, 0))

    assert classify(done("stop")) is None and classify(done("length")) is None
    assert classify(done("error")) == FailureKind.INVALID
    assert classify(done("cancelled")) == FailureKind.INVALID
    assert classify(done("expired")) == FailureKind.TRANSIENT
    policy = RetryPolicy(request_timeout=1, backoff_base=1, backoff_cap=4)
    assert [policy.backoff(n) <= cap for n, cap in ((1, 1), (2, 2), (3, 4), (9, 4))] == [True] * 4


def test_invalid_options_fail_the_job_before_anything_is_sent(redis_url, redis_client):
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        analyze_document("text", "Summarise.", model=MODEL, sampling={"bogus": 1},
                         redis_url=redis_url)
    with pytest.raises(ValueError, match="overlap_tokens"):
        analyze_document("text", "Summarise.", model=MODEL, chunk_tokens=10, overlap_tokens=10,
                         redis_url=redis_url)
    with pytest.raises(ValueError, match="model_wait_timeout"):
        analyze_document("text", "Summarise.", model=MODEL, redis_url=redis_url,
                         model_wait_timeout=-1)
    with pytest.raises(ValueError, match="not registered"):  # ModelNotFound, after no wait
        analyze_document("text", "Summarise.", model=MODEL, redis_url=redis_url,
                         model_wait_timeout=0)
    assert redis_client.xlen(KEYS.requests(MODEL, "batch")) == 0


def test_a_reduce_that_would_cut_every_answer_to_a_fragment_is_refused_before_the_map(
        redis_url, redis_client, tiny_llama, start_worker):
    """reduce_max_tokens near the model's length leaves a reduce prompt no room for two whole
    chunk answers: refused before anything is sent (it made five levels of fragments); so is
    a blank document."""
    start_worker(**FAST)
    text = document(tokenizer_of(tiny_llama), 1_000, seed=2)
    with pytest.raises(ValueError, match="chunk answers of up to max_tokens 64 would be cut"):
        analyze_document(text, "Summarise.", model=MODEL, redis_url=redis_url,
                         chunk_tokens=300, overlap_tokens=20, max_tokens=64,
                         reduce_max_tokens=2000)
    for blank in ("", "  \n\n "):  # (nothing to analyse: no answer made up for it)
        with pytest.raises(ValueError, match="the document is empty"):
            analyze_document(blank, "Summarise.", model=MODEL, redis_url=redis_url)
    assert redis_client.xlen(KEYS.requests(MODEL, "batch")) == 0


def test_a_job_with_invalid_options_fails_once_and_is_not_retried(redis_url):
    queue = bulk_queue(redis_url)
    jobs = [enqueue_analyze(queue, "text", "Summarise.", model=MODEL, **bad)
            for bad in ({"chunk_tokens": 0}, {"watch_ttl": 0}, {"bogus": 1})]
    assert all(job.retries_left == 3 for job in jobs)  # what a worker's death would use

    failures: list[str] = []
    run_burst(redis_url, exception_handlers=[lambda job, *exc: failures.append(job.id)])

    assert sorted(failures) == sorted(job.id for job in jobs)  # one run each: no retry
    for job in jobs:
        job.refresh()
        assert job.get_status() == "failed" and job.retries_left == 0


def test_the_options_are_one_dataclass_built_from_the_jobs_json_kwargs(redis_url):
    flat = {"model": MODEL, "chunk_tokens": 64, "sampling": {"top_p": 0.5},
            "redis_url": redis_url}
    options = AnalyzeOptions.from_dict(json.loads(json.dumps(flat)))
    assert (options.model, options.chunk_tokens, options.sampling) == (MODEL, 64, {"top_p": 0.5})
    assert json.loads(json.dumps(asdict(options))) == asdict(options)  # JSON through and back
    with pytest.raises(ValueError, match="unknown analysis option"):
        AnalyzeOptions.from_dict({"model": MODEL, "chunk_size": 64})
    with pytest.raises(ValueError, match="needs a model"):
        AnalyzeOptions.from_dict({"chunk_tokens": 64})
    # The dict and the dataclass are the same job as flat keyword arguments.
    for given in ({**flat, "overlap_tokens": 64}, AnalyzeOptions(**flat, overlap_tokens=64)):
        with pytest.raises(ValueError, match="overlap_tokens"):
            analyze_document("text", "Summarise.", given)


def test_the_job_finds_the_fleet_on_the_server_rq_uses(redis_url):
    conn = connect(redis_url)
    assert connect(fleet_url_for(conn)).ping()
    tcp = connect("redis://user:p%40ss@example.org:6380/3")
    assert fleet_url_for(tcp) == "redis://user:p%40ss@example.org:6380/3"


# --- whole jobs ------------------------------------------------------------------------------


def test_a_20k_token_document_is_mapped_chunk_by_chunk_and_reduced(
        redis_url, redis_client, tiny_llama, start_worker):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    tok = tokenizer_of(tiny_llama)
    text = document(tok, 20_000)
    doc_ids = tok.encode(text, add_special_tokens=False).ids
    job = enqueue_analyze(bulk_queue(redis_url), text, "List the places named.", model=MODEL,
                          chunk_tokens=1500, overlap_tokens=100, max_tokens=4)

    run_burst(redis_url)

    job.refresh()
    assert job.get_status() == "finished", job.latest_result().exc_string
    result = job.return_value()
    n = count_chunks(len(doc_ids), 1500, 100)
    assert len(doc_ids) >= 20_000 and n >= 14
    assert result["num_tokens"] == len(doc_ids) and result["num_chunks"] == n
    chunks = result["chunks"]
    assert [(c["index"], c["start"], c["end"]) for c in chunks] == [
        (s.index, s.start, s.end) for s in split(len(doc_ids), 1500, 100)]
    # Each chunk went out as token ids: the template around the exact document slice.
    templates = Templates(tok, "List the places named.", REDUCE_INSTRUCTION)
    sent = {r.request_id: r for r in batch_requests(redis_client)}
    for c in chunks:
        [rid] = c["request_ids"]
        assert sent[rid].prompt is None and sent[rid].lane == "batch"
        assert sent[rid].prompt_token_ids == templates.chunk_prompt(
            doc_ids[c["start"]:c["end"]], c["index"], n)
        assert c["usage"]["prompt_tokens"] == len(sent[rid].prompt_token_ids)
        assert c["usage"]["completion_tokens"] <= 4 and c["attempts"] == 1
    assert redis_client.xlen(KEYS.requests(MODEL, "interactive")) == 0
    # One reduce over all the short answers; its text is the answer.
    reduces = result["reduce"]["requests"]
    assert result["reduce"]["levels"] == 1 and len(reduces) == 1
    assert reduces[0]["inputs"] == list(range(n)) and result["answer"] == reduces[0]["text"]
    assert len(sent) == n + 1
    # Usage adds up, and progress reached the total.
    usage = result["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens")} == \
        total_usage(chunks + reduces)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["requests"] == n + 1
    meta = job.get_meta()
    assert meta["chunks_done"] == meta["chunks_total"] == n
    assert meta["stage"] == "done" and meta["usage"] == usage
    assert result["timings"]["total_s"] >= result["timings"]["map_s"] > 0
    assert job.timeout == job_timeout_for(text) > job_timeout_for("a short note")


def test_answers_too_long_for_one_context_are_reduced_in_levels(
        redis_url, tiny_llama, start_worker):
    start_worker(**FAST)
    tok = tokenizer_of(tiny_llama)
    text = document(tok, 6_000, seed=1)
    # 100-token answers from ~25 chunks: about 2,600 tokens, more than the 2,048 context.
    job = enqueue_analyze(bulk_queue(redis_url), text, "Summarise.", model=MODEL,
                          chunk_tokens=250, overlap_tokens=10, max_tokens=100,
                          reduce_max_tokens=8, sampling={"ignore_eos": True})

    run_burst(redis_url)

    job.refresh()
    assert job.get_status() == "finished", job.latest_result().exc_string
    result = job.return_value()
    assert all(c["usage"]["completion_tokens"] == 100 for c in result["chunks"])
    reduces = result["reduce"]["requests"]
    assert result["reduce"]["levels"] >= 2
    first = [r for r in reduces if r["level"] == 1]
    assert len(first) >= 2
    assert all(r["usage"]["prompt_tokens"] <= 2048 - 8 for r in reduces)
    last = max(reduces, key=lambda r: r["level"])
    assert result["answer"] == last["text"]
    assert result["usage"]["requests"] == result["num_chunks"] + len(reduces)
    assert job.get_meta()["reduce_level"] == result["reduce"]["levels"]


def test_a_chunk_the_fleet_refuses_fails_the_job_at_once_with_the_reason(
        redis_url, redis_client, tiny_llama, start_worker):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    text = document(tokenizer_of(tiny_llama), 3_000, seed=2)
    # 2,100-token chunks cannot fit the 2,048-token model.
    job = enqueue_analyze(bulk_queue(redis_url), text, "Summarise.", model=MODEL,
                          chunk_tokens=2100, overlap_tokens=0, max_tokens=4)

    run_burst(redis_url)

    job.refresh()
    assert job.get_status() == "failed"
    meta = job.get_meta()
    # Failed on the fleet's refusal itself: not after a timeout, and never retried.
    assert "max length" in meta["error"] and "2048" in meta["error"]
    assert "timed out" not in meta["error"] and "no final" not in meta["error"]
    assert meta["retries"] == 0 and meta["error"] in job.latest_result().exc_string
    assert len(batch_requests(redis_client)) == 2  # the two chunks, each tried once
    # RQ would retry a job that died; this one failed for good, and ran once.
    assert job.retries_left == 0 and meta["runs"] == 1
    assert redis_client.hget(journal_key(job.id), "runs") == b"1"


def test_nothing_rq_stores_for_a_job_is_pickled(redis_url, redis_client, tiny_llama,
                                                start_worker):
    start_worker(**FAST)
    job = enqueue_analyze(bulk_queue(redis_url), "A short note about the harbour.",
                          "Summarise.", model=MODEL, max_tokens=4)
    run_burst(redis_url)

    stored = redis_client.hgetall(f"rq:job:{job.id}")
    args = json.loads(zlib.decompress(stored[b"data"]))  # JSON, where pickle is RQ's default
    assert args[0] == "producer.bulk.analyze_document"
    assert args[3]["text"] == "A short note about the harbour."
    assert json.loads(stored[b"meta"])["stage"] == "done"
    [(_, entry)] = redis_client.xrange(f"rq:results:{job.id}")
    result = json.loads(base64.b64decode(entry[b"return_value"]))
    assert result["num_chunks"] == 1 and result["reduce"]["levels"] == 0
    # No value RQ wrote anywhere starts with a pickle protocol header.
    for key in redis_client.scan_iter(match="rq:*"):
        kind = redis_client.type(key)
        values = []
        if kind == b"hash":
            values = list(redis_client.hgetall(key).values())
        elif kind == b"stream":
            values = [v for _, f in redis_client.xrange(key) for v in f.values()]
        for value in values:
            assert not value.startswith(b"\x80"), (key, value[:20])
            if value[:1] == b"x":
                assert not zlib.decompress(value).startswith(b"\x80")
    # Enqueued by function path with the JSON serializer, it reads back as JSON too.
    again = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
    assert again.kwargs["model"] == MODEL


def test_a_chunk_whose_worker_is_killed_is_resubmitted_and_the_job_finishes(
        redis_url, redis_client, tiny_llama, start_worker):
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    doomed = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker", "--model", str(tiny_llama),
         "--served-model-name", MODEL, "--redis", redis_url, "--name", "doomed",
         "--threads", "1", "--dtype", "float32", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rq_worker = None
    try:
        eventually(lambda: redis_client.exists(KEYS.model(MODEL)), "the worker to register")
        text = document(tokenizer_of(tiny_llama), 900, seed=3)
        job = enqueue_analyze(bulk_queue(redis_url), text, "Summarise.", model=MODEL,
                              chunk_tokens=400, overlap_tokens=0, max_tokens=150,
                              reduce_max_tokens=4, sampling={"ignore_eos": True},
                              request_timeout=8, backoff_base=0.2)
        # `conveyor bulk worker`: RQ's own `rq worker` may hang a minute as it stops
        # (producer/bulk/workers.py).
        rq_worker = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "bulk", "worker", "--burst",
             "--redis", redis_url],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def held_by_doomed() -> list:
            try:
                return redis_client.xpending_range(KEYS.requests(MODEL, "batch"), GROUP, "-",
                                                   "+", 10, consumername="doomed")
            except redis.ResponseError:  # NOGROUP: registered, its groups not made yet
                return []

        eventually(held_by_doomed, "the doomed worker to take a chunk", poll_s=0.005)
        doomed.send_signal(signal.SIGSTOP)  # frozen at once, whatever the machine's speed
        held = held_by_doomed()
        assert held  # the fault takes effect: it dies holding unfinished work
        lost_ids = {GenerationRequest.decode(fields[FIELD]).request_id
                    for h in held
                    for _, fields in redis_client.xrange(KEYS.requests(MODEL, "batch"),
                                                         h["message_id"], h["message_id"])}
        assert lost_ids  # the requests of the entries it holds
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        start_worker(**FAST)
        assert rq_worker.wait(120) == 0, rq_worker.stderr.read().decode()[-2000:]
    finally:
        for proc in (doomed, rq_worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)

    job = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() == "finished", job.latest_result().exc_string
    result = job.return_value()
    retried = [c for c in result["chunks"] if c["attempts"] > 1]
    assert result["retries"] >= len(retried)
    for c in retried:
        assert len(set(c["request_ids"])) == c["attempts"]  # a new id for every try
    # Each chunk the killed worker held was tried again under a new id. (On a slow machine
    # a healthy chunk may also pass its request timeout: it is cancelled and tried again.)
    for lost in lost_ids:
        [chunk] = [c for c in result["chunks"] if lost in c["request_ids"]]
        assert chunk["attempts"] > 1 and chunk["request_ids"][-1] != lost
        # Nobody finished the lost request: no final, or (once its lease ran out and a
        # worker claimed it) the final of the cancel the job sent when it gave up on it.
        entries = [decode_output(f[FIELD]) for _, f in redis_client.xrange(KEYS.output(lost))]
        finals = [e for e in entries if isinstance(e, FinalEntry)]
        assert all(f.finish_reason == FinishReason.CANCELLED for f in finals), finals
    assert all(c["usage"]["completion_tokens"] == 150 for c in result["chunks"])
    assert job.get_meta()["retries"] == result["retries"]


def test_the_cli_enqueues_an_analysis_follows_it_and_shows_its_status(
        redis_url, tiny_llama, start_worker, tmp_path, capsys):
    start_worker(**FAST)
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    rq_worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "bulk", "worker", "--redis", redis_url],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        doc = tmp_path / "doc.txt"
        tok = tokenizer_of(tiny_llama)
        doc.write_text(document(tok, 1_000, seed=4))
        n = count_chunks(len(tok.encode(doc.read_text(), add_special_tokens=False).ids), 300, 20)
        status = bulk("analyze", str(doc), "--instruction", "Summarise.", "--chunk-tokens",
                      "300", "--overlap-tokens", "20", "--max-tokens", "4", "--json",
                      "--redis", redis_url)
    finally:
        rq_worker.send_signal(signal.SIGTERM)
        rq_worker.wait(30)
    out, err = capsys.readouterr()
    assert status == 0, err
    # With --json, stdout is the result's JSON (for jq; this process's log lines are
    # there too), the job id on stderr.
    result = json.loads(out[out.index("{\n"):out.rindex("\n}") + 2])
    assert not any(JOB_ID.fullmatch(line) for line in out.splitlines())
    [job_id] = [line for line in err.splitlines() if JOB_ID.fullmatch(line)]
    assert f"chunks {n}/{n}" in err and "finished" in err

    assert bulk("status", job_id, "--json", "--redis", redis_url) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["status"] == "finished" and info["func"] == "producer.bulk.analyze_document"
    assert info["meta"]["chunks_done"] == n and info["result"]["num_chunks"] == n
    assert info["result"] == result
    assert bulk("status", "no-such-job", "--follow", "--redis", redis_url) == 1
    assert "no such job: no-such-job" in capsys.readouterr().err


def test_a_started_job_whose_lease_ran_out_says_its_worker_died(redis_url, redis_client):
    """Nothing waits in silence: a job left ``started`` by a dead worker says so, by RQ's own
    test (its run's lease in the started-job registry ran out, at the clock given), until
    a bulk worker retries it; one whose lease holds does not."""
    from rq.job import JobStatus
    from rq.registry import StartedJobRegistry

    job = enqueue_analyze(bulk_queue(connection=redis_client), "text", "Summarise.",
                          model=MODEL)
    job.set_status(JobStatus.STARTED)
    lease_ends = 1_800_000_000.0
    redis_client.zadd(StartedJobRegistry(job.origin, connection=redis_client).key,
                      {f"{job.id}:run-1": lease_ends})
    held = job_progress(job, now=lease_ends - 3)
    assert held["abandoned_s"] is None and "died" not in describe_progress(held)
    lapsed = job_progress(job, now=lease_ends + 25)
    assert lapsed["abandoned_s"] == 25.0
    assert "its worker died" in describe_progress(lapsed)


@pytest.mark.parametrize("cls", ["BulkWorker", "BulkSimpleWorker"])
def test_a_bulk_worker_stops_its_command_listener_at_once(redis_url, cls):
    """RQ's own order (unsubscribe, then stop the listener) can leave the listener waiting
    60 s for a subscription, and redis-py's stop() waits for it: a worker's exit hung for a
    minute (about one stop in ten here). Each time here, unsubscribe() returns well within
    that minute, and the listener has ended by then."""
    import threading

    import producer.bulk.workers as workers

    connection = connect(redis_url)
    try:
        queue = Queue("conveyor-bulk", connection=connection, serializer=JSONSerializer)
        worker = getattr(workers, cls)([queue], connection=connection,
                                       serializer=JSONSerializer)
        for _ in range(20):
            worker.subscribe()
            thread = worker.pubsub_thread
            eventually(lambda t=thread: t.is_alive() and worker.pubsub.subscribed,
                       "the listener subscribed")
            stopping = threading.Thread(target=worker.unsubscribe, daemon=True)
            stopping.start()
            stopping.join(timeout=10)
            assert not stopping.is_alive(), "unsubscribe() waited on the listener"
            assert not thread.is_alive()
    finally:
        connection.close()


def test_an_analysis_with_a_json_schema_answers_json_valid_against_it(
        redis_url, tiny_llama, start_worker):
    """Every chunk's answer and the reduced one are held to the schema (the grammar does the
    work on random weights): each parsed into "json", the answer into "answer_json"."""
    import jsonschema

    start_worker(**FAST)
    tok = tokenizer_of(tiny_llama)
    text = document(tok, 3_000)
    schema = {"type": "object", "properties": {
        "places": {"type": "array", "items": {"type": "string", "maxLength": 8},
                   "maxItems": 3}},
              "required": ["places"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "places", "schema": schema}}
    job = enqueue_analyze(bulk_queue(redis_url), text, "List the places named.", model=MODEL,
                          chunk_tokens=1200, overlap_tokens=100, max_tokens=128,
                          sampling={"temperature": 1.0, "seed": 4, "response_format": form})
    run_burst(redis_url)
    job.refresh()
    assert job.get_status() == "finished", job.latest_result().exc_string
    result = job.return_value()
    assert result["num_chunks"] >= 3  # precondition: a map and a reduce
    for part in (*result["chunks"], *result["reduce"]["requests"]):
        assert part["finish_reason"] == "stop"
        jsonschema.validate(part["json"], schema)
    jsonschema.validate(result["answer_json"], schema)
    assert json.loads(result["answer"]) == result["answer_json"]


def test_bulk_cancel_stops_a_running_analysis_and_cancels_its_requests(
        redis_url, redis_client, tiny_llama, start_worker, capsys):
    """`bulk cancel` stops a started job (never retried) and cancels the requests its journal
    holds in flight at once; a queued job is cancelled, an ended or unknown one said so."""
    start_worker(**FAST)
    queue = bulk_queue(connection=redis_client)
    waiting = enqueue_analyze(queue, "text", "Summarise.", model=MODEL)  # (behind the other)
    assert bulk("cancel", waiting.id, "--redis", redis_url) == 0
    assert "canceled" in capsys.readouterr().err
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    rq_worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "bulk", "worker", "--redis", redis_url],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        tok = tokenizer_of(tiny_llama)
        job = enqueue_analyze(queue, document(tok, 1_500, seed=9), "Summarise.", model=MODEL,
                              chunk_tokens=300, overlap_tokens=20, max_tokens=1500,
                              reduce_max_tokens=64,
                              sampling={"temperature": 0, "ignore_eos": True})
        journal = JobJournal(redis_client, job.id)

        def streaming() -> list[str] | None:
            ids = journal.in_flight()
            return ids if ids and all(redis_client.xlen(KEYS.output(i)) for i in ids) else None

        in_flight = eventually(streaming, "the job's requests streaming")
        assert job_progress(job)["status"] == "started"  # (precondition)
        assert bulk("cancel", job.id, "--redis", redis_url) == 0
        assert "requests in flight cancelled" in capsys.readouterr().err
        assert job_progress(job)["status"] == "stopped"
        with Client(redis_url) as client:
            assert {client.result(i, timeout=60).finish_reason for i in in_flight} == {
                FinishReason.CANCELLED}
    finally:
        rq_worker.send_signal(signal.SIGTERM)
        rq_worker.wait(30)
    assert bulk("cancel", job.id, "--redis", redis_url) == 0
    assert "had already ended: stopped" in capsys.readouterr().err
    assert bulk("cancel", "no-such-job", "--redis", redis_url) == 1


def test_a_cancelled_journal_stops_the_run_going_on_and_any_retry(redis_client):
    """What `bulk cancel` leaves where its stop cannot reach (a dead worker's job, retried
    later; a worker that runs jobs in its own process): the run going on is superseded at
    its next write, before it sends anything more, and a retry stops at its beginning."""
    running = JobJournal(redis_client, "cancelled-job")
    running.begin("plan")
    running.sending({"chunk-0": Sent("r0", "lane")})
    running.cancel()
    assert running.in_flight() == ["r0"]
    with pytest.raises(Superseded):
        running.sending({"chunk-1": Sent("r1", "lane")})
    with pytest.raises(Cancelled, match="cancelled"):
        JobJournal(redis_client, "cancelled-job").begin("plan")
    assert running.in_flight() == ["r0"]  # (nothing more was sent)
