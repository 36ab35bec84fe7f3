"""The offline engine: add requests, step, read tokens. The worker's loop drives the same API.

Requests are checked on the way in (``admission``) and stepped overlapped or not
(``step_pipeline``). KV from another engine comes in through one narrow hook,
``add_request(preloaded=...)`` after ``settle`` (worker/fleet/handoff/engine_kv.py)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore import PrefixHit
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.completion import Completion, FinishReason
from producer.wire.params import SamplingParams
from producer.wire.validation import validate_choice_id
from scheduler import Request, RequestUpdate, Scheduler
from scheduler.deadlines import Deadlines
from worker.engine import output_processor
from worker.engine.admission import AdmissionChecks, Prompt, prompts_and_params, sampling_params
from worker.engine.config import EngineConfig
from worker.engine.memory import kv_memory, load_forward
from worker.engine.model_runner import ModelRunner
from worker.engine.output_processor import RequestOutputState, StepOutput, merged_outputs
from worker.engine.simulated import SimulatedRunner, step_cost
from worker.engine.step_pipeline import OverlappedSteps
from worker.engine.tokenizer import Tokenizer
from worker.models import native_decode
from worker.sampling import fresh_seed

# Scheduler counters (since start) that stats() reports: preemptions by kind, blocks swapped,
# prefix cache use, prompt tokens computed or whose KV came from another engine (handoffs).
REPORTED_COUNTERS = ("preemptions_swap", "preemptions_recompute", "swapped_out_blocks",
                     "swapped_in_blocks", "prefix_cache_queries", "prefix_cache_hit_tokens",
                     "prompt_tokens_computed", "kv_imported_tokens")


class Engine:
    """Continuous batching over a paged KV cache for one model on one device.

    ``Engine(model_dir, **settings)`` takes any field of ``EngineConfig``; ``clock`` decides
    when deadlines pass (the real clock unless a test brings its own).
    """

    def __init__(self, model_dir: str | Path, *, clock: Clock | None = None,
                 **settings: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(settings)
        self.clock = clock or SYSTEM_CLOCK
        self.model_dir = Path(model_dir)
        # A simulated engine (worker/engine/simulated.py) reads config.json and the
        # tokenizer only: no weights, no KV tensors, no forward.
        self.simulated_cost = step_cost(cfg.simulate_step_ms, cfg.simulate_cost)
        self.simulated = self.simulated_cost is not None
        self.device, self.dtype, self.model, mc = load_forward(cfg, model_dir, self.simulated)
        self.model_config = mc
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.memory = memory = kv_memory(cfg, mc, self.device, self.dtype, self.max_model_len,
                                         tensors_too=not self.simulated, forward=self.model)
        self.kv_cache, self.block_pool, self.kv = memory.cache, memory.pool, memory.manager
        self.host_cache, self.host_pool = memory.host_cache, memory.host_pool
        self.scheduler = Scheduler(cfg.scheduler_config(self.max_model_len), self.kv)
        self.checks = AdmissionChecks.of(model_dir, self.tokenizer, mc, self.max_model_len,
                                         cfg.block_size, self.block_pool.num_blocks,
                                         self.simulated)
        self.runner = (SimulatedRunner(self.simulated_cost, mc.vocab_size, self.eos_token_ids,
                                       self.clock) if self.simulated_cost is not None else
                       ModelRunner(self.model, self.kv_cache, self.device, self.host_cache,
                                   self.checks.grammars, memory.graphs))
        # Overlapped steps (worker/engine/step_pipeline.py): on by default on CUDA and for a
        # simulated engine, whose steps stand for a GPU's.
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.device.type == "cuda" or self.simulated)
        self._pipeline = (OverlappedSteps(self.runner, self.device, self.scheduler,
                                          self._step_outputs, self.clock)
                          if self.async_scheduling else None)
        # Live requests with penalties (each reads every token: no step of theirs overlaps).
        self._num_penalized = 0
        self._outputs: dict[str, RequestOutputState] = {}
        self._ids = itertools.count()
        self._deadlines = Deadlines()
        self.num_steps = 0

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
        preloaded: PrefixHit | None = None,
    ) -> str:
        """Queue a request; raises ValueError on bad input, leaving the engine untouched.

        ``generated_token_ids`` resumes a request whose first tokens were already produced
        (by a crashed worker or before a preemption) exactly as the uninterrupted request
        would have gone on. ``deadline`` (unix seconds) ends the request as ``expired`` at
        the first step after it, keeping what it produced.
        ``preloaded``, the one hook for KV from another engine: held blocks that already
        hold the KV of the request's first tokens (worker/fleet/handoff/engine_kv.py fills
        them, after ``settle``); those tokens are not computed again, and
        ``usage.kv_transferred_tokens`` counts them. The request owns the blocks once added;
        when this raises, they are still the caller's to release.
        """
        params = sampling_params(params)
        # (choice i > 0 of a request with several is served as "{id}.{i}")
        request_id = validate_choice_id(request_id or f"req-{next(self._ids)}")
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids, generated, limit = self.checks.admit(prompt, params, generated_token_ids,
                                                         preloaded is not None)
        seed = params.seed if params.seed is not None else fresh_seed()

        req = Request(request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=limit,
                      priority=priority, eos_token_ids=self.eos_token_ids,
                      stop_token_ids=frozenset(params.stop_token_ids),
                      ignore_eos=params.ignore_eos, output_token_ids=list(generated),
                      sampling_params=params, seed=seed)
        req.preloaded = preloaded
        state = RequestOutputState.create(request_id, params, seed, len(prompt_ids),
                                          self.tokenizer if self.config.detokenize else None,
                                          prompt_token_ids=None if generated else prompt_ids)
        if generated:
            state.add_tokens(generated, None)
            state.take_delta(final=False)  # already delivered by whoever produced them
        self.scheduler.add_request(req)
        self._outputs[request_id] = state
        if params.penalized:
            self._num_penalized += 1
        if deadline is not None:
            self._deadlines.add(request_id, deadline, state)
        return request_id

    def token_ids(self, request_id: str) -> list[int]:
        """The request's prompt and output token ids so far (a copy; overlapped, without
        the token of the step still running)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is not known here")
        tokens = req.all_token_ids()
        return tokens[:-1] if req.pending_token else tokens

    def abort(self, request_id: str,
              reason: FinishReason = FinishReason.CANCELLED) -> StepOutput | None:
        """End a request now; returns its final output, or None if it is unknown.

        Overlapped: the running step is finished first, so the request keeps every token
        computed for it, as with plain steps; what that step gave it not yet returned by
        ``step()`` comes in this final output instead.
        """
        if request_id not in self.scheduler.requests:
            return None
        self.settle()
        earlier = self._pipeline.take_ready(request_id) if self._pipeline is not None else []
        if self.scheduler.finish_request(request_id, reason) is None:
            # The running step ended it: its final, held for the next step(), is the answer.
            return merged_outputs(earlier) if earlier and earlier[-1].finished else None
        final = self._final_output(request_id, [], reason)
        return merged_outputs([*earlier, final]) if earlier else final

    def settle(self) -> None:
        """Finish the running step of overlapped steps, if any (its outputs come with the
        next step()): the KV and tokens of every request are then what the scheduler says."""
        if self._pipeline is not None:
            self._pipeline.settle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._pipeline is not None
                                                   and self._pipeline.busy)

    def close(self) -> None:
        """Stop the runner thread of overlapped steps (after the step it runs, if any); the
        engine steps no more after this."""
        if self._pipeline is not None:
            self._pipeline.close()

    @property
    def num_overlapped_steps(self) -> int:
        """Steps scheduled while the step before them ran (overlapped steps only)."""
        return self._pipeline.num_overlapped_steps if self._pipeline is not None else 0

    # ----- one step -----

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward, sample; returns what each advanced request gained.

        With overlapped steps (``async_scheduling``) the forward runs on the runner thread,
        and a call returns what the step before it gained, once it has handed its own step
        over: outputs come one call later, and a last call with nothing left to schedule
        returns the last step's.
        """
        # Overlapped, each expiry finishes the running step first (abort).
        expired = [out for rid in self._deadlines.overdue(self.clock.time())
                   if (out := self.abort(rid, FinishReason.EXPIRED)) is not None]
        if self._pipeline is not None:
            outputs, stepped = self._pipeline.step(expired, must_sync=self._num_penalized > 0)
            self.num_steps += stepped
            return outputs
        began = self.clock.monotonic()  # (what the step cost: the inter-token target's)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.runner.release(sched)
            return expired
        tokens, logprobs, prompt = self.runner.execute(sched)
        self.num_steps += 1
        updates = self.scheduler.update(sched, tokens)
        outputs = expired + self._step_outputs(updates, logprobs, prompt)
        self.scheduler.observe_step(sched, self.clock.monotonic() - began)
        return outputs

    def _step_outputs(self, updates: list[RequestUpdate], logprobs: dict[str, Any],
                      prompt: output_processor.PromptSpans) -> list[StepOutput]:
        results, states = [], self._outputs  # (every running request, every step)
        output_processor.add_prompt_spans(states, prompt)  # (a prefill chunk has no update)
        for upd in updates:
            request_id, new, lp = upd.request_id, upd.new_token_ids, logprobs.get(upd.request_id)
            opening = (state := states[request_id]).opening()  # (before its tokens are in)
            state.num_cached_tokens = upd.num_cached_tokens
            state.num_transferred_tokens = upd.num_transferred_tokens
            if state.detokenizer is None and lp is None:  # the fleet's: nothing else to do
                state.token_ids.extend(new)
            else:
                state.add_tokens(new, lp)
            reason = FinishReason(upd.finish_reason) if upd.finished else None
            if (failed := self.runner.grammar_failures.pop(request_id, None)) is not None:
                self.scheduler.finish_request(request_id, FinishReason.ERROR)  # (if running)
                reason, state.error = FinishReason.ERROR, failed
            if reason is None and state.hit_stop_string:
                self.scheduler.finish_request(request_id, FinishReason.STOP)
                reason = FinishReason.STOP
            if reason is not None:
                out = self._final_output(request_id, new, reason, lp)
            else:  # (no text without a detokenizer: the fleet's)
                text = state.take_delta(final=False) if state.detokenizer is not None else ""
                out = StepOutput(request_id, new, text, False, None, [lp] if lp else None, None,
                                 state.num_cached_tokens)
            # (its first output: with the prompt's logprobs, where it asked for them)
            out.prompt_token_ids, out.prompt_logprobs = opening or (None, None)
            results.append(out)
        return results

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Mapping[str, Any]
                 | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion; one Completion per prompt, in order."""
        ids = [self.add_request(p, sp) for p, sp in prompts_and_params(prompts, params)]
        done: dict[str, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.completion is not None:
                    done[out.request_id] = out.completion
        return [done[i] for i in ids]

    def stats(self) -> dict[str, int]:
        """Counters (since start) and gauges (now) of this engine."""
        return {
            "steps": self.num_steps,
            "forwards": self.runner.num_forwards,
            "computed_tokens": self.runner.num_computed_tokens,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "swapped": self.scheduler.num_swapped,
            "preemptions": self.scheduler.num_preemptions,
            # A decode step's tasks taken over from a late thread (process-wide; CPU only).
            "step_team_takeovers": native_decode.team_takeovers()
            if self.device.type == "cpu" and not self.simulated else 0,
            # 1 for a simulated engine (worker/engine/simulated.py): tokens not the model's.
            "simulated": int(self.simulated),
            # Milliseconds its simulated steps took (a GPU busy; the rest it waited for us).
            "simulated_busy_ms": int(getattr(self.runner, "simulated_ms", 0)),
            **{name: self.scheduler.counters[name] for name in REPORTED_COUNTERS},
            **self.memory.stats(), **self.checks.grammar_stats(), **self.scheduler.cost_stats(),
        }

    # ----- helpers -----

    def _final_output(self, request_id: str, new_ids: list[int], reason: FinishReason,
                      logprob: Any = None) -> StepOutput:
        state = self._outputs.pop(request_id)
        if state.params.penalized:
            self._num_penalized -= 1
        self._deadlines.discard(request_id)
        state.finish_text()
        return StepOutput(request_id, new_ids, state.take_delta(final=True), True, reason,
                          [logprob] if logprob else None, state.completion(
                              reason, state.num_cached_tokens), state.num_cached_tokens)

