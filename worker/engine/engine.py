"""The offline engine: add requests, step, read tokens. The worker's loop drives the same API."""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from kvstore import BlockPool, KVCacheManager, OutOfBlocksError, PrefixHit, blocks_for
from kvstore.handoff import KVHandoff
from kvstore.kv_tensors import PagedKVCache, block_layout, export_blocks, import_blocks
from kvstore.prefix_hash import extend_chain
from kvstore.tier.header import BlockLayout
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.completion import Completion, FinishReason
from producer.wire.params import SamplingParams
from producer.wire.validation import validate_request_id, validate_token_ids
from scheduler import Request, RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from worker.attention.torch_backend import keep_cudnn_attention_off
from worker.engine.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.output_processor import RequestOutputState, StepOutput
from worker.engine.step_pipeline import RunnerThread, StepResult
from worker.engine.tokenizer import Tokenizer
from worker.host.allocator import keep_large_allocations_in_heap
from worker.host.device import engine_device, engine_dtype
from worker.models import native_decode
from worker.models.fingerprint import model_fingerprint
from worker.models.loader import load_model
from worker.sampling import fresh_seed

Prompt = str | Sequence[int]


class Engine:
    """Continuous batching over a paged KV cache for one model on one device.

    ``Engine(model_dir, **settings)`` takes any field of ``EngineConfig``; ``clock`` decides
    when deadlines pass (the real clock unless a test brings its own).
    """

    def __init__(self, model_dir: str | Path, *, clock: Clock | None = None,
                 **settings: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(settings)
        self.clock = clock or SYSTEM_CLOCK
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.device = engine_device(cfg.device)
        if self.device.type == "cpu" and cfg.tune_host_allocator:
            keep_large_allocations_in_heap()
        if self.device.type == "cuda":
            keep_cudnn_attention_off()  # a plan per shape: 12x the decode step (its docstring)
        self.dtype = engine_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu":
            # Load (or build, once per machine) the CPU decode kernel now, not mid-step.
            from worker.host.cpu_kernels import paged_decode_kernel

            paged_decode_kernel()
        self.model_dir = Path(model_dir)
        self.model = load_model(model_dir, self.dtype, self.device, cfg.attention_backend)
        if self.device.type == "cpu":
            native_decode.prepare(self.model)  # the packed weights, now, not mid-step
        self.model_config = mc = self.model.config
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.eos_token_ids = frozenset(mc.eos_token_ids)

        num_blocks = cfg.num_kv_blocks or self._blocks_for_gib(cfg.kv_cache_memory_gib, cap=True)
        self.kv_cache = self._kv_tensors(num_blocks, self.device)
        self.block_pool = BlockPool(num_blocks, shuffle_seed=cfg.block_shuffle_seed)
        swap_blocks = (cfg.swap_blocks if cfg.swap_blocks is not None
                       else self._blocks_for_gib(cfg.swap_space_gib, cap=False))
        if cfg.preemption_mode == "recompute":
            swap_blocks = 0
        self.host_pool = BlockPool(swap_blocks) if swap_blocks else None
        self.host_cache = (self._kv_tensors(swap_blocks, torch.device("cpu"),
                                            pin=self.device.type == "cuda")
                           if swap_blocks else None)
        self.kv = KVCacheManager(self.block_pool, cfg.block_size, host_pool=self.host_pool,
                                 enable_prefix_caching=cfg.enable_prefix_caching,
                                 watermark_blocks=max(1, num_blocks // 100))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_prefill_chunk=cfg.max_prefill_chunk,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                max_model_len=self.max_model_len,
                preemption_mode=cfg.preemption_mode,
            ),
            self.kv,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.host_cache)
        # Overlapped steps (worker/engine/step_pipeline.py): on by default on CUDA only.
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._pipeline = RunnerThread(self.runner, self.device) if self.async_scheduling else None
        # The step running on the runner thread (scheduled, advanced, tokens not applied).
        self._inflight: tuple[SchedulerOutput, Future[StepResult]] | None = None
        # Outputs of a step finished outside step() (to read KV or tokens): the next step's.
        self._ready: list[StepOutput] = []
        # The last step scheduled beside a running one left a request out for lack of
        # blocks: schedule the next with nothing running, so that it may preempt.
        self._sync_next = False
        # Live requests with penalties: they read every output token, so no step of theirs
        # is scheduled before the step before it has its tokens.
        self._num_penalized = 0
        self._outputs: dict[str, RequestOutputState] = {}
        self._ids = itertools.count()
        # (deadline, tie-break, request id, its output state): the state tells a live entry
        # from one left by a finished request whose id was reused since.
        self._deadlines: list[tuple[float, int, str, RequestOutputState]] = []
        # Live requests that have a deadline: past twice as many heap entries, the entries
        # of finished requests are dropped (the heap must not grow with every request).
        self._with_deadline: set[str] = set()
        self.num_steps = 0
        # Steps scheduled while the step before them ran (overlapped steps only).
        self.num_overlapped_steps = 0

    # ----- requests -----

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        generated_token_ids: Sequence[int] = (),
        deadline: float | None = None,
        kv: KVHandoff | None = None,
    ) -> str:
        """Queue a request; raises ValueError on bad input, leaving the engine untouched.

        ``generated_token_ids`` resumes a request whose first tokens were already
        produced (by a crashed worker or before a preemption): it continues
        exactly as the uninterrupted request would have. ``deadline`` (unix seconds) ends
        the request as ``expired`` at the first step after it, keeping what it produced.
        ``kv`` brings the KV of the request's first tokens from another engine (checked by
        the caller against :meth:`kv_layout`); those tokens are not computed again, and
        ``usage.kv_transferred_tokens`` counts them. It must leave at least one token to
        compute; ValueError if it does not, or if its blocks do not fit now.
        """
        params = self._params(params)
        request_id = validate_request_id(request_id or f"req-{next(self._ids)}")
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        vocab = self.model_config.vocab_size
        if any(token >= vocab for token, _ in params.logit_bias):
            raise ValueError(f"logit_bias names a token id outside the vocabulary [0, {vocab})")
        generated = (validate_token_ids(list(generated_token_ids), self.model_config.vocab_size,
                                        "generated_token_ids") if generated_token_ids else [])
        limit = self._token_limit(prompt_ids, params)
        self._check_lengths(prompt_ids, generated, params, limit)
        seed = params.seed if params.seed is not None else fresh_seed()

        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=limit,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            output_token_ids=list(generated),
            sampling_params=params,
            seed=seed,
        )
        if kv is not None:
            self._settle()  # the runner thread must not be writing blocks we are about to fill
            req.preloaded = self._hold_imported_kv(kv, len(prompt_ids) + len(generated))
        state = RequestOutputState.create(request_id, params, seed, len(prompt_ids),
                                          self.tokenizer if self.config.detokenize else None)
        try:
            if generated:
                state.add_tokens(generated, None)
                state.take_delta(final=False)  # already delivered by whoever produced them
            self.scheduler.add_request(req)
        except Exception:
            if req.preloaded is not None:  # the engine stays untouched: no held blocks
                self.kv.release_hold(req.preloaded)
            raise
        self._outputs[request_id] = state
        if params.penalized:
            self._num_penalized += 1
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._ids), request_id, state))
            self._with_deadline.add(request_id)
        return request_id

    def token_ids(self, request_id: str) -> list[int]:
        """The request's prompt and output token ids so far (a copy; overlapped, without
        the token of the step still running)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is not known here")
        tokens = req.all_token_ids()
        return tokens[:-1] if req.pending_token else tokens

    def export_kv(self, request_id: str) -> KVHandoff:
        """The KV of every token of ``request_id`` computed so far (after the step that
        sampled its first token: the whole prompt), for another engine to continue from."""
        self._settle()
        req = self.scheduler.requests.get(request_id)
        if req is None or not req.status.running:
            raise ValueError(f"request {request_id!r} is not running here")
        n = req.num_computed_tokens
        blocks = self.kv.block_table(request_id)[:blocks_for(n, self.config.block_size)]
        return KVHandoff(n, export_blocks(self.kv_cache, blocks))

    def export_prefix_blocks(self, request_id: str) -> list[tuple[bytes, bytes]]:
        """(chain hash, bytes) of every full block of the request's prompt computed so far,
        for the fleet tier's prefix sharing (the hash names the whole prefix to that block).
        A step still running never writes these blocks: no need to wait for it."""
        req = self.scheduler.requests.get(request_id)
        if req is None or not req.status.running:
            raise ValueError(f"request {request_id!r} is not running here")
        bs = self.config.block_size
        full = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
        if full == 0:
            return []
        hashes = extend_chain(req.block_hashes, req.all_token_ids, bs, full)
        table = self.kv.block_table(request_id)
        return [(h, export_blocks(self.kv_cache, [table[i]])) for i, h in enumerate(hashes)]

    @functools.cached_property
    def fingerprint(self) -> str:
        """This engine's model by content (worker.models.fingerprint), computed on first use."""
        return model_fingerprint(self.model_dir, str(self.dtype).removeprefix("torch."))

    def kv_layout(self, fingerprint: str | None = None) -> BlockLayout:
        """What this engine's KV blocks are, for the fleet tier's checks (``fingerprint``:
        this engine's own unless given)."""
        return block_layout(self.kv_cache, fingerprint or self.fingerprint)

    def _hold_imported_kv(self, kv: KVHandoff, total_tokens: int) -> PrefixHit:
        if not 0 < kv.num_tokens < total_tokens:
            raise ValueError(f"imported KV covers {kv.num_tokens} tokens: it must cover at "
                             f"least one and leave one of the request's {total_tokens} to "
                             "compute")
        try:
            hit = self.kv.hold_blocks(kv.num_tokens)
        except OutOfBlocksError as exc:
            raise ValueError(f"no room for the imported KV now: {exc}") from exc
        try:
            if kv.block_payloads:
                for block_id, payload in zip(hit.block_ids, kv.block_payloads, strict=True):
                    import_blocks(self.kv_cache, [block_id], payload)
            else:
                import_blocks(self.kv_cache, hit.block_ids, kv.payload)
        except Exception:
            self.kv.release_hold(hit)
            raise
        return hit

    def abort(self, request_id: str,
              reason: FinishReason = FinishReason.CANCELLED) -> StepOutput | None:
        """End a request now; returns its final output, or None if it is unknown.

        Overlapped: the running step is finished first, so the request keeps every token
        computed for it, as with plain steps; what that step gave it not yet returned by
        ``step()`` comes in this final output instead.
        """
        if request_id not in self.scheduler.requests:
            return None
        self._settle()
        earlier = [o for o in self._ready if o.request_id == request_id]
        if earlier:
            self._ready = [o for o in self._ready if o.request_id != request_id]
        if self.scheduler.finish_request(request_id, reason) is None:
            # The running step ended it: its final, held for the next step(), is the answer.
            return self._merged(earlier) if earlier and earlier[-1].finished else None
        final = self._final_output(request_id, [], reason)
        return self._merged([*earlier, final]) if earlier else final

    @staticmethod
    def _merged(outputs: list[StepOutput]) -> StepOutput:
        """Several outputs of one request as one (the last one's ending)."""
        last = outputs[-1]
        logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
        return StepOutput(last.request_id, [t for o in outputs for t in o.new_token_ids],
                          "".join(o.text_delta for o in outputs), last.finished,
                          last.finish_reason, logprobs or None, last.completion,
                          last.num_cached_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._ready)

    def close(self) -> None:
        """Stop the runner thread of overlapped steps (after the step it runs, if any); the
        engine steps no more after this."""
        if self._pipeline is not None:
            self._pipeline.close()

    # ----- one step -----

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward, sample; returns what each advanced request gained.

        With overlapped steps (``async_scheduling``) the forward runs on the runner thread,
        and a call returns what the step before it gained, once it has handed its own step
        over: outputs come one call later, and a last call with nothing left to schedule
        returns the last step's.
        """
        if self._pipeline is not None:
            return self._step_overlapped(self._pipeline)
        expired = self._expire_overdue()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.runner.release(sched)
            return expired
        tokens, logprobs = self.runner.execute(sched)
        self.num_steps += 1
        return expired + self._step_outputs(self.scheduler.update(sched, tokens), logprobs)

    def _step_overlapped(self, pipeline: RunnerThread) -> list[StepOutput]:
        expired = self._expire_overdue()  # (each expiry finishes the running step first)
        outputs, self._ready = self._ready + expired, []
        if self._inflight is not None and (self._sync_next or self._num_penalized):
            outputs += self._finish_inflight()
        before = self._inflight
        sched = self.scheduler.schedule(may_preempt=before is None)
        self._sync_next = sched.starved
        if sched.is_empty:
            pipeline.submit(self.runner.release, sched)  # after the running step, in order
            return outputs + (self._finish_inflight() if before is not None else [])
        future = pipeline.submit_step(sched, before[1] if before is not None else None)
        self.num_steps += 1
        if before is not None:
            self.num_overlapped_steps += 1
            outputs += self._finish_inflight()
        # After the running step's tokens: a request they finished gets no pending token.
        self.scheduler.advance(sched)
        self._inflight = (sched, future)
        return outputs

    def _finish_inflight(self) -> list[StepOutput]:
        """Wait for the running step's tokens and apply them."""
        assert self._inflight is not None
        sched, future = self._inflight
        self._inflight = None
        tokens, logprobs = future.result()
        return self._step_outputs(self.scheduler.resolve(sched, tokens), logprobs)

    def _settle(self) -> None:
        """Finish the running step, if any (its outputs come with the next step()): its
        KV and tokens are then what the scheduler says they are."""
        if self._inflight is not None:
            self._ready += self._finish_inflight()

    def _step_outputs(self, updates: list[RequestUpdate],
                      logprobs: dict[str, Any]) -> list[StepOutput]:
        results = []
        for upd in updates:
            state = self._outputs[upd.request_id]
            state.num_cached_tokens = upd.num_cached_tokens
            state.num_transferred_tokens = upd.num_transferred_tokens
            state.add_tokens(upd.new_token_ids, logprobs.get(upd.request_id))
            reason = FinishReason(upd.finish_reason) if upd.finished else None
            if reason is None and state.hit_stop_string:
                self.scheduler.finish_request(upd.request_id, FinishReason.STOP)
                reason = FinishReason.STOP
            if reason is not None:
                results.append(self._final_output(upd.request_id, upd.new_token_ids, reason,
                                                  logprobs.get(upd.request_id)))
            else:
                lp = logprobs.get(upd.request_id)
                results.append(StepOutput(upd.request_id, upd.new_token_ids,
                                          state.take_delta(final=False),
                                          logprobs=[lp] if lp else None,
                                          num_cached_tokens=state.num_cached_tokens))
        return results

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion; one Completion per prompt, in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams | Mapping):
            per_prompt = [params] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        done: dict[str, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.completion is not None:
                    done[out.request_id] = out.completion
        return [done[i] for i in ids]

    def stats(self) -> dict[str, int]:
        """Counters (since start) and gauges (now) of this engine."""
        c = self.scheduler.counters
        return {
            "steps": self.num_steps,
            "forwards": self.runner.num_forwards,
            "computed_tokens": self.runner.num_computed_tokens,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "swapped": self.scheduler.num_swapped,
            "kv_blocks_total": self.block_pool.num_blocks,
            "kv_blocks_used": self.block_pool.num_used,
            "kv_blocks_cached": self.block_pool.num_cached,
            "host_blocks_total": self.host_pool.num_blocks if self.host_pool else 0,
            "host_blocks_used": self.host_pool.num_used if self.host_pool else 0,
            "preemptions": self.scheduler.num_preemptions,
            # A decode step's tasks taken over from a late thread (process-wide; CPU only).
            "step_team_takeovers": native_decode.team_takeovers()
            if self.device.type == "cpu" else 0,
            "preemptions_swap": c["preemptions_swap"],
            "preemptions_recompute": c["preemptions_recompute"],
            "swapped_out_blocks": c["swapped_out_blocks"],
            "swapped_in_blocks": c["swapped_in_blocks"],
            "prefix_cache_queries": c["prefix_cache_queries"],
            "prefix_cache_hit_tokens": c["prefix_cache_hit_tokens"],
            "prefix_cache_evictions": self.block_pool.num_evictions,
            # Prompt tokens this engine computed (prefill, recompute), and whose KV it
            # imported instead (handoffs).
            "prompt_tokens_computed": c["prompt_tokens_computed"],
            "kv_imported_tokens": c["kv_imported_tokens"],
        }

    # ----- helpers -----

    def _expire_overdue(self) -> list[StepOutput]:
        """Finish requests whose deadline has passed, before or during generation."""
        outs = []
        now = self.clock.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid, state = heapq.heappop(self._deadlines)
            if self._outputs.get(rid) is state and (
                    out := self.abort(rid, FinishReason.EXPIRED)) is not None:
                outs.append(out)
        return outs

    def _final_output(self, request_id: str, new_ids: list[int], reason: FinishReason,
                      logprob: Any = None) -> StepOutput:
        state = self._outputs.pop(request_id)
        if state.params.penalized:
            self._num_penalized -= 1
        self._with_deadline.discard(request_id)
        if len(self._deadlines) > 2 * len(self._with_deadline):
            self._deadlines = [d for d in self._deadlines if self._outputs.get(d[2]) is d[3]]
            heapq.heapify(self._deadlines)
        state.finish_text()
        return StepOutput(request_id, new_ids, state.take_delta(final=True), True, reason,
                          [logprob] if logprob else None,
                          state.completion(reason, state.num_cached_tokens),
                          state.num_cached_tokens)

    def _params(self, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, Mapping):
            return SamplingParams.from_dict(params)
        raise ValueError(f"params must be SamplingParams or a mapping, got {type(params).__name__}")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass the prompt as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            prompt = self.tokenizer.encode(prompt)
        return validate_token_ids(prompt, self.model_config.vocab_size)

    def _token_limit(self, prompt: list[int], params: SamplingParams) -> int:
        """Most tokens the request may generate: its ``max_tokens``; without one, until the
        context is full, or until the whole KV pool is, where the pool holds less (the
        request then ends ``length`` there rather than waiting for blocks that cannot
        exist)."""
        if params.max_tokens is not None:
            return params.max_tokens
        pool_tokens = self.block_pool.num_blocks * self.config.block_size
        return max(1, min(params.token_limit, pool_tokens - len(prompt)))

    def _check_lengths(self, prompt: list[int], generated: list[int],
                       params: SamplingParams, limit: int) -> None:
        n = len(prompt) + len(generated)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate: the model's max length is "
                f"{self.max_model_len} tokens"
            )
        if len(generated) >= limit:
            raise ValueError(f"already {len(generated)} generated tokens, max_tokens is "
                             f"{limit}")
        peak = min(len(prompt) + limit, self.max_model_len)
        if blocks_for(peak, self.config.block_size) > self.block_pool.num_blocks:
            raise ValueError(
                f"request needs up to {peak} tokens of KV, more than the whole KV pool "
                f"({self.block_pool.num_blocks} blocks of {self.config.block_size})"
            )

    def _kv_tensors(self, num_blocks: int, device: torch.device, pin: bool = False) -> PagedKVCache:
        mc = self.model_config
        return PagedKVCache(mc.num_hidden_layers, num_blocks, self.config.block_size,
                            mc.num_key_value_heads, mc.head_dim, self.dtype, device, pin)

    def _blocks_for_gib(self, gib: float, cap: bool) -> int:
        """Blocks that fit ``gib``; with ``cap``, no more than max_num_seqs full sequences use."""
        mc = self.model_config
        per_block = PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.config.block_size,
                                                 mc.num_key_value_heads, mc.head_dim, self.dtype)
        fits = int(gib * 2**30) // per_block
        if not cap:
            return fits
        useful = self.config.max_num_seqs * blocks_for(self.max_model_len, self.config.block_size)
        return max(1, min(fits, useful))
