"""Iteration-level scheduling: which requests compute which tokens in the next step."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable

from kvstore import KVCacheManager, PrefixHit
from producer.wire.completion import FinishReason
from scheduler.config import SchedulerConfig
from scheduler.output import (
    PENDING_TOKEN,
    NewRequestData,
    RequestUpdate,
    ScheduledChunk,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus
from scheduler.step_cost import (
    MIN_PREFILL_TOKENS,
    StepCostModel,
    StepFeatures,
    chunk_seconds,
    prefill_within,
)


class Scheduler:
    """Builds each step under a token budget and applies the runner's results.

    Each step serves running decodes first, then running partial prefills, then
    swapped-out requests coming back, then waiting requests by (priority, arrival).
    When a running request cannot get its next block, the least urgent running
    request is preempted: swapped to the host tier or dropped for recompute. A step
    that preempted brings nothing back and admits nothing new.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Swapped-out requests, served before new admissions (most urgent first).
        self.swapped: list[Request] = []
        # Heap of (priority, arrival, request); finished entries are skipped when popped.
        self._waiting: list[tuple[int, int, Request]] = []
        self._num_waiting = 0
        self._arrivals = itertools.count()
        self.counters: Counter[str] = Counter()
        # Requests finished since the last schedule(): the next output tells the runner.
        self._finished_ids: list[str] = []
        # Waiting requests holding imported KV (Request.preloaded).
        self._num_holding = 0
        # False while a step is scheduled beside a running one (schedule(may_preempt=False)).
        self._may_preempt = True
        # With an inter-token target: what steps cost (learnt from the engine's), the seconds
        # of the step being scheduled its prefill may still take (None: no limit), and the
        # prefill tokens it still holds whatever they cost (a prompt always progresses).
        self.step_cost = StepCostModel()
        self._prefill_left_s: float | None = None
        self._prefill_floor = 0

    # ----- queue -----

    def add_request(self, req: Request) -> None:
        """Queue a request; it holds no KV until it is scheduled."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.arrival = next(self._arrivals)
        req.status = RequestStatus.WAITING
        # stop_reason's rules, folded once: a token in stop_ids is "stop"; "length" once
        # output_limit tokens are out (max_tokens, or the model's length reached).
        req.stop_ids = (req.stop_token_ids if req.ignore_eos
                        else req.stop_token_ids | req.eos_token_ids)
        req.output_limit = min(req.max_tokens,
                               self.config.max_model_len - len(req.prompt_token_ids))
        if req.preloaded is not None:
            self._num_holding += 1
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request now (cancel, stop string, deadline); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status.running:
            self.running.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
        else:
            self._num_waiting -= 1  # its heap entry is dropped when it surfaces, or below
            if len(self._waiting) > 2 * self._num_waiting:
                # Mostly entries of finished requests: rebuild, so the heap never keeps them.
                self._waiting = [e for e in self._waiting if e[2] is not req
                                 and e[2].status is not RequestStatus.FINISHED]
                heapq.heapify(self._waiting)
        self._finish(req, reason)
        return req

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_preemptions(self) -> int:
        return self.counters["preemptions_swap"] + self.counters["preemptions_recompute"]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----- one step -----

    def schedule(self, may_preempt: bool = True) -> SchedulerOutput:
        """Choose this step's chunks within the token budget.

        ``may_preempt`` False (a step scheduled while the previous one runs): a running
        request that cannot grow waits instead, and the output says it starved.
        """
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self._may_preempt = may_preempt
        scheduled: dict[str, ScheduledChunk] = {}
        self._prefill_left_s = self._prefill_seconds()
        self._prefill_floor = MIN_PREFILL_TOKENS
        budget, later = self._schedule_running(self.config.max_num_batched_tokens, scheduled,
                                               out)
        if not out.preempted_ids:
            # (with prompts put after admission: only requests more urgent than they are)
            bound = min((r.priority for r in later), default=None)
            budget = self._swap_in(budget, scheduled, out, bound)
            budget = self._admit_waiting(budget, scheduled, out, bound)
        if later:  # what the more urgent requests left of the target's share
            # A request admitted this step is never a victim: the prompts wait instead.
            may_preempt, self._may_preempt = self._may_preempt, False
            self._schedule_general(later, budget, scheduled, out)
            self._may_preempt = may_preempt
        out.chunks = list(scheduled.values())
        return out

    def _prefill_seconds(self) -> float | None:
        """Seconds of this step its prefill may take so that it stays within the inter-token
        target while requests decode (None: no target, nothing decoding, prompts unchunked,
        or the cost not learnt yet). Each chunk is sized by it where its start is known
        (``_tokens_to_schedule``): a prefix hit's or a resumed prompt's tokens attend over
        more than a new prompt's."""
        target_ms = self.config.itl_target_ms
        if not target_ms or not self.config.enable_chunked_prefill or not self.step_cost.ready:
            return None
        gen = RequestStatus.RUNNING_GEN
        decoding = [r for r in self.running if r.status is gen]
        if not decoding:
            return None  # nobody waits on this step's tokens: prefill at full budget
        context = sum(r.num_computed_tokens + 1 for r in decoding)
        decodes_s = self.step_cost.predict(StepFeatures(0, len(decoding), context))
        return max(0.0, target_ms / 1000 - decodes_s)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step of ``out`` took ``seconds``: the cost model learns it (only with a target)."""
        if not self.config.itl_target_ms or not out.chunks:
            return
        self.step_cost.observe(StepFeatures.of(out.chunks), seconds)

    def cost_stats(self) -> dict[str, float]:
        """The learnt step cost in seconds (with an inter-token target; else nothing)."""
        if not self.config.itl_target_ms or not self.step_cost.steps:
            return {}
        names = ("step_cost_base_s", "step_cost_prefill_token_s", "step_cost_decode_row_s",
                 "step_cost_context_token_s", "step_cost_chunk_attention_s")
        return dict(zip(names, self.step_cost.coefficients, strict=True))

    def _took_prefill(self, req: Request, n: int) -> None:
        """``req`` takes a chunk of ``n`` from its computed tokens on (``_chunk``)."""
        if self._prefill_left_s is not None and n > 1:
            spent = chunk_seconds(self.step_cost, req.num_computed_tokens, n)
            self._prefill_left_s = max(0.0, self._prefill_left_s - spent)
            self._prefill_floor = max(0, self._prefill_floor - n)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Apply a step's results: advance progress, append sampled tokens, finish requests."""
        # Runs for every scheduled request every step: attributes and lengths are read
        # directly, once each, not through Request's properties.
        updates = []
        caching, block_size = self.kv.enable_prefix_caching, self.kv.block_size
        gen, ctx = RequestStatus.RUNNING_GEN, RequestStatus.RUNNING_CTX
        requests, counters = self.requests, self.counters
        for chunk in out.chunks:
            request_id = chunk.request_id
            req = requests.get(request_id)
            if req is None or (req.status is not gen and req.status is not ctx):
                continue  # finished (e.g. cancelled) while the step ran
            before = req.num_computed_tokens
            after = req.num_computed_tokens = before + len(chunk.token_ids)
            num_prompt = len(req.prompt_token_ids)
            if before < num_prompt:  # prefill (or recompute) of the prompt
                counters["prompt_tokens_computed"] += min(after, num_prompt) - before
            # Blocks become full only when a chunk crosses a block boundary; a fresh table
            # (admission, swap-in) may also have full blocks not yet registered.
            if caching and (chunk.num_known_blocks == 0
                            or after // block_size > before // block_size):
                self.kv.cache_computed(request_id, after, req.all_token_ids, req.block_hashes)
            if not chunk.sample:
                continue
            token = sampled[request_id]
            outputs = req.output_token_ids
            outputs.append(token)
            req.status = gen
            reason = self._stop_reason(req, token)
            updates.append(
                RequestUpdate(request_id, [token], False, None, req.num_cached_tokens,
                              req.num_transferred_tokens)
                if reason is None else self._stopped(req, token, reason))
        return updates

    def _stopped(self, req: Request, token: int, reason: FinishReason) -> RequestUpdate:
        """``token`` ended the running request ``req`` for ``reason``: finish it."""
        self.running.remove(req)
        self._finish(req, reason)
        return RequestUpdate(req.request_id, [token], True, str(reason), req.num_cached_tokens,
                             req.num_transferred_tokens)

    # ----- overlapped steps: a step's progress first, its sampled tokens later -----

    def advance(self, out: SchedulerOutput) -> None:
        """Apply a step that is still running, as far as it is known without its tokens:
        progress, and a PENDING_TOKEN in place of each token it samples, so the next step
        can be scheduled now. ``resolve`` brings the tokens. A request whose pending token
        reaches a length limit is not scheduled again; it finishes in ``resolve``."""
        out.advanced = advanced = []
        # Compared by identity: an Enum's property (status.running) costs a call a request.
        gen, ctx = RequestStatus.RUNNING_GEN, RequestStatus.RUNNING_CTX
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or (req.status is not gen and req.status is not ctx):
                advanced.append(None)
                continue  # finished (a stop string, a cancel) since it was scheduled
            advanced.append(req)
            req.num_computed_tokens = chunk.start_position + len(chunk.token_ids)
            if not chunk.sample:
                continue
            outputs = req.output_token_ids
            outputs.append(PENDING_TOKEN)
            req.pending_token = True
            req.status = gen
            # Only a length can be known before the token is (_stop_reason, inline).
            req.finishing = len(outputs) >= req.output_limit

    def resolve(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Apply the tokens of a step ``advance`` applied before (the step after it may have
        been scheduled meanwhile): each pending token becomes the real one, full blocks go
        into the prefix cache, and requests stop as ``update`` would stop them."""
        updates = []
        caching, block_size = self.kv.enable_prefix_caching, self.kv.block_size
        gen, ctx = RequestStatus.RUNNING_GEN, RequestStatus.RUNNING_CTX
        counters = self.counters
        for chunk, req in zip(out.chunks, out.advanced, strict=True):
            # Ended since (its id may name a new request by now: not this step's).
            if req is None or (req.status is not gen and req.status is not ctx):
                continue
            before = chunk.start_position
            after = before + len(chunk.token_ids)
            if before < len(req.prompt_token_ids):
                counters["prompt_tokens_computed"] += \
                    min(after, len(req.prompt_token_ids)) - before
            # Every token up to `after` is known once this step's token is (the input it
            # read in place of a pending token was resolved with the step before).
            if caching and (chunk.num_known_blocks == 0
                            or after // block_size > before // block_size):
                if chunk.sample:
                    req.output_token_ids[chunk.output_index] = sampled[chunk.request_id]
                self.kv.cache_computed(req.request_id, after, req.all_token_ids,
                                       req.block_hashes)
            if not chunk.sample:
                continue
            token = req.output_token_ids[chunk.output_index] = sampled[chunk.request_id]
            req.pending_token = False
            # Stopped by this token? (_stop_reason, inline: every decoding request, every step)
            if (token in req.stop_ids or len(req.output_token_ids) >= req.output_limit) and \
                    (reason := self._stop_reason(req, token)) is not None:
                updates.append(self._stopped(req, token, reason))
            else:
                updates.append(RequestUpdate(req.request_id, [token], False, None,
                                             req.num_cached_tokens, req.num_transferred_tokens))
        return updates

    # ----- the three sources of work -----

    def _schedule_running(self, budget: int, scheduled: dict[str, ScheduledChunk],
                          out: SchedulerOutput) -> tuple[int, list[Request]]:
        """Decodes and partial prefills; the budget left, and the partial prefills put after
        admission (an inter-token target's small share goes to the more urgent first: a
        batch document's chunks must not hold an interactive prompt back for its whole
        prefill)."""
        # One pass serves the common decode inline (nobody to preempt: its next token fits
        # in a block it holds, or starts one that is free): this runs for every running
        # request every step. Taking the free block in its place keeps a steady batch's
        # order step after step (the runner lays its sampling rows out once for it). The
        # rest (from the first decode whose block is not free, every decode that needs a
        # block, then partial prefills) takes the general path after it, in order.
        gen, ctx = RequestStatus.RUNNING_GEN, RequestStatus.RUNNING_CTX
        kv = self.kv
        tables = kv.block_tables
        block_capacity = kv.block_size
        growing, prefills = [], []
        for req in self.running:
            status = req.status
            if status is ctx:
                prefills.append(req)
                continue
            if status is not gen or req.finishing:
                continue
            request_id = req.request_id
            table = tables.get(request_id, ())
            num_blocks = len(table)
            if num_blocks * block_capacity <= req.num_computed_tokens:
                if growing or not kv.can_append_slots(request_id, req.num_computed_tokens + 1):
                    growing.append(req)
                    continue
                if budget == 0:
                    return budget, []
                kv.append_slots(request_id, req.num_computed_tokens + 1)
                table = tables[request_id]
                num_blocks = len(table)
            if budget == 0:
                return budget, []
            # ScheduledChunk of the one newest token, from which a token is sampled.
            known, req.num_blocks_sent = req.num_blocks_sent, num_blocks
            outputs = req.output_token_ids
            scheduled[request_id] = ScheduledChunk(
                request_id, [outputs[-1] if outputs else req.prompt_token_ids[-1]],
                req.num_computed_tokens, table[known:], known, True, len(outputs))
            budget -= 1
        later: list[Request] = []
        if self._prefill_left_s is not None and prefills:
            most_urgent = self._most_urgent_queued()
            if most_urgent is not None:
                later = [r for r in prefills if r.priority > most_urgent]
                if later:
                    prefills = [r for r in prefills if r.priority <= most_urgent]
        return self._schedule_general(itertools.chain(growing, prefills), budget, scheduled,
                                      out), later

    def _schedule_general(self, reqs: Iterable[Request], budget: int,
                          scheduled: dict[str, ScheduledChunk], out: SchedulerOutput) -> int:
        """Running requests off the common decode path, in order: decodes that need a block
        (making room, maybe by preemption), then partial prefills."""
        for req in reqs:
            if budget == 0:
                break
            if not req.status.running:
                continue  # preempted earlier in this loop
            n = self._tokens_to_schedule(req, budget)
            if n == 0:
                continue
            fits, given_back = self._make_room(req, n, scheduled, out)
            budget += given_back
            if not fits:
                continue
            self.kv.append_slots(req.request_id, req.num_computed_tokens + n)
            scheduled[req.request_id] = self._chunk(req, n)
            budget -= n
        return budget

    def _swap_in(self, budget: int, scheduled: dict[str, ScheduledChunk],
                 out: SchedulerOutput, more_urgent_than: int | None = None) -> int:
        self.swapped.sort(key=Request.urgency_key)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if more_urgent_than is not None and req.priority >= more_urgent_than:
                break
            n = self._tokens_to_schedule(req, budget)
            if n == 0 or not self.kv.can_swap_in(req.request_id, req.num_computed_tokens + n):
                break  # the most urgent swapped request comes back first, or nobody does
            self.swapped.pop(0)
            out.swap_in += self.kv.swap_in(req.request_id)
            self.counters["swapped_in_blocks"] += len(self.kv.block_table(req.request_id))
            self.kv.append_slots(req.request_id, req.num_computed_tokens + n)
            req.status = (RequestStatus.RUNNING_GEN if req.num_uncomputed_tokens == 1
                          else RequestStatus.RUNNING_CTX)
            self.running.append(req)
            scheduled[req.request_id] = self._chunk(req, n)
            out.new_requests.append(self._new_request_data(req))
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledChunk],
                       out: SchedulerOutput, more_urgent_than: int | None = None) -> int:
        deferred = []
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._waiting[0][2]
            if req.status is RequestStatus.FINISHED:
                heapq.heappop(self._waiting)
                continue
            if more_urgent_than is not None and req.priority >= more_urgent_than:
                break
            if req.preloaded is not None:
                hit = req.preloaded
            elif req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
                hit = PrefixHit(block_size=self.kv.block_size)  # its whole prompt computed
            else:
                hit = self.kv.prefix_lookup(req.all_token_ids(), req.block_hashes)
            if hit.pending:
                # Another running request is computing this prefix now: wait and share it.
                deferred.append(heapq.heappop(self._waiting))
                continue
            req.num_computed_tokens = hit.num_tokens
            n = self._tokens_to_schedule(req, budget)
            if n == 0 and self._prefill_left_s is not None:
                req.num_computed_tokens = 0
                break  # the inter-token target's share is spent: not a lack of memory
            # Head-of-line: a request that does not fit waits, and so does everyone behind it.
            if n == 0 or not self.kv.can_allocate(hit.num_tokens + n, hit):
                req.num_computed_tokens = 0
                if self._drop_holds_behind(req):
                    continue  # imported KV of requests behind it was all that was in the way
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            self.kv.allocate(req.request_id, hit.num_tokens + n, hit)
            if req.preloaded is not None:  # imported KV: the request holds it now
                self.kv.release_hold(req.preloaded)
                req.preloaded = None
                self._num_holding -= 1
                req.admitted_once = True
                req.num_transferred_tokens = hit.num_tokens
                self.counters["kv_imported_tokens"] += hit.num_tokens
            else:
                self._count_prefix_hit(req, hit.num_tokens)
            req.status = RequestStatus.RUNNING_CTX
            self.running.append(req)
            scheduled[req.request_id] = self._chunk(req, n)
            out.new_requests.append(self._new_request_data(req))
            budget -= n
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return budget

    def _drop_holds_behind(self, head: Request) -> bool:
        """Give back the imported KV that waiting requests other than ``head`` hold (they
        will compute their prompts instead): held blocks must never keep the head of the
        queue out for good. Whether any was given back."""
        if self._num_holding == 0 or (self._num_holding == 1 and head.preloaded is not None):
            return False
        dropped = 0
        for _, _, other in self._waiting:
            if other is not head and other.preloaded is not None:
                self.kv.release_hold(other.preloaded)
                other.preloaded = None
                dropped += 1
        self._num_holding -= dropped
        self.counters["kv_imports_dropped"] += dropped
        return dropped > 0

    # ----- preemption -----

    def _make_room(
        self, req: Request, n: int, scheduled: dict[str, ScheduledChunk], out: SchedulerOutput
    ) -> tuple[bool, int]:
        """Preempt the least urgent running requests until ``req`` can grow by ``n`` tokens.

        Returns whether ``req`` fits (False when it was the least urgent and got
        preempted itself) and the budget freed by unscheduling victims.
        """
        given_back = 0
        while not self.kv.can_append_slots(req.request_id, req.num_computed_tokens + n):
            if not self._may_preempt:
                out.starved = True
                return False, given_back
            victim = max(self.running, key=Request.urgency_key)
            dropped = scheduled.pop(victim.request_id, None)
            given_back += dropped.num_tokens if dropped else 0
            self._preempt(victim, out)
            if victim is req:
                return False, given_back
        return True, given_back

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device: swap its KV to the host, or drop it."""
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.num_blocks_sent = 0
        out.preempted_ids.append(req.request_id)
        if self._should_swap(req):
            pairs = self.kv.swap_out(req.request_id)
            out.swap_out += pairs
            req.preempted_by = "swap"
            self.counters["preemptions_swap"] += 1
            self.counters["swapped_out_blocks"] += len(pairs)
            self.swapped.append(req)
        else:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.preempted_by = "recompute"
            self.counters["preemptions_recompute"] += 1
            self._push_waiting(req)

    def _should_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(req.request_id):
            return False
        return mode == "swap" or req.num_computed_tokens >= self.kv.block_size

    # ----- helpers -----

    def _tokens_to_schedule(self, req: Request, budget: int) -> int:
        n = req.num_uncomputed_tokens
        if n <= 1:
            return min(n, budget)
        if not self.config.enable_chunked_prefill:
            return n if n <= budget else 0
        n = min(n, budget, self.config.chunk_cap)
        if self._prefill_left_s is not None:  # (the inter-token target's share of the step)
            n = prefill_within(self.step_cost, self._prefill_left_s, req.num_computed_tokens,
                               min(self._prefill_floor, n), n)
        return n

    def _most_urgent_queued(self) -> int | None:
        """The priority of the most urgent request waiting or swapped out (None: none)."""
        waiting = self._waiting
        while waiting and waiting[0][2].status is RequestStatus.FINISHED:
            heapq.heappop(waiting)  # (an entry left by a finished request)
        swapped = min((r.priority for r in self.swapped), default=None)
        if not waiting:
            return swapped
        return waiting[0][0] if swapped is None else min(waiting[0][0], swapped)

    def _count_prefix_hit(self, req: Request, hit_tokens: int) -> None:
        self.counters["prefix_cache_queries"] += req.num_tokens
        self.counters["prefix_cache_hit_tokens"] += hit_tokens
        if not req.admitted_once:
            req.num_cached_tokens = min(hit_tokens, req.num_prompt_tokens)
            req.admitted_once = True

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        """``req``'s next ``n`` tokens as this step's chunk (what an inter-token target's
        share has left is charged for them)."""
        self._took_prefill(req, n)
        start = req.num_computed_tokens
        table = self.kv.block_table(req.request_id)
        known, req.num_blocks_sent = req.num_blocks_sent, len(table)
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_slice(start, start + n),
            start_position=start,
            new_block_ids=table[known:],
            num_known_blocks=known,
            sample=start + n == req.num_tokens,
            output_index=req.num_output_tokens,
        )

    @staticmethod
    def _new_request_data(req: Request) -> NewRequestData:
        """What the runner keeps of ``req`` from the step that gives it a table of its own
        (no token of it is pending then: it ran in no step since it was last preempted)."""
        return NewRequestData(req.request_id, req.sampling_params, req.seed,
                              req.prompt_token_ids, list(req.output_token_ids))

    def _push_waiting(self, req: Request) -> None:
        heapq.heappush(self._waiting, (req.priority, req.arrival, req))
        self._num_waiting += 1

    @staticmethod
    def _stop_reason(req: Request, token: int) -> FinishReason | None:
        """producer.wire.stopping.stop_reason for ``req``, whose newest output token is
        ``token``, through the rules add_request folded into it."""
        if token in req.stop_ids and \
                len(req.output_token_ids) >= req.sampling_params.min_tokens:
            return FinishReason.STOP
        if len(req.output_token_ids) >= req.output_limit:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.kv.free(req.request_id)
        if req.preloaded is not None:  # ended before admission adopted its imported KV
            self.kv.release_hold(req.preloaded)
            req.preloaded = None
            self._num_holding -= 1
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
