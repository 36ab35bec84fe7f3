"""Runs one scheduled step: flat ragged inputs, one forward, logits of the last tokens, sampling."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from kvstore.kv_tensors import PagedKVCache, copy_blocks
from producer.wire.completion import TokenLogprob
from scheduler.output import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
from worker.attention.metadata import AttentionMetadata
from worker.engine.block_table_rows import BlockTableRows
from worker.host.step_upload import StepUpload
from worker.models.decode_graphs import DecodeGraphs
from worker.sampling import Sampler
from worker.sampling.grammar import Grammars
from worker.sampling.prompt_logprobs import PromptLogprobs, PromptSpan
from worker.sampling.rows import SamplingRows


class ModelRunner:
    """Turns a SchedulerOutput into one forward pass over the paged cache."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 host_cache: PagedKVCache | None = None, grammars: Grammars | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        # Decode steps replayed from CUDA graphs (worker/models/decode_graphs.py), where
        # captured; every other step (and all of them without) runs the layers eagerly.
        self.graphs = graphs
        # Called right before each step's forward (the fleet's engine loop hands the step
        # before's output to its publisher there: see worker/fleet/engine_loop.py).
        self.on_forward: Callable[[], object] | None = None
        self.kv_cache = kv_cache
        self.host_cache = host_cache
        self.device = device
        # On CUDA swaps are queued on their own stream; the compute stream waits for them
        # before the forward reads the restored blocks.
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.sampler = Sampler()
        # The attention backend, which stages its per-step plan with the step's inputs, and
        # the logits' width (a top-k of all of it cuts nothing).
        self.attention_backend = model.attention_backend
        self.vocab_size: int = model.config.vocab_size
        # Each running request's block table, kept across steps (a step's tables are
        # gathered from them into its one upload).
        self.block_tables = BlockTableRows()
        # Each running request's parameters, seed and penalty tokens, kept across steps
        # (handed over once: SchedulerOutput.new_requests), and the step's row layout.
        self.sampling_rows = SamplingRows(eos_token_ids=model.config.eos_token_ids,
                                          grammars=grammars)
        # Requests that still want their prompt's logprobs (made in their prefill).
        self.prompt_logprobs = PromptLogprobs()
        # Requests whose grammar failed in a step, and why (the engine ends them: error).
        self.grammar_failures: dict[str, str] = {}
        # Counters that tests and stats read: forwards run and tokens fed to the model.
        self.num_forwards = 0
        self.num_computed_tokens = 0

    def queued(self, out: SchedulerOutput) -> None:
        """The engine hands ``out`` to the runner thread (overlapped steps): nothing to do;
        its forward is launched when ``execute`` runs it (a SimulatedRunner times from here)."""

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, pending: dict[str, int] | None = None,
    ) -> tuple[dict[str, int], dict[str, TokenLogprob | None], dict[str, PromptSpan]]:
        """Compute every chunk of the step; sample a token for each chunk that asks for one.
        Returns the sampled tokens and their logprobs by request, and the spans of prompt
        logprobs the step's prefill chunks made (worker/sampling/prompt_logprobs.py).

        ``pending``: the tokens the step before sampled, by request (overlapped steps): a
        chunk's PENDING_TOKEN input is that request's.
        """
        self._swap(out)
        self.release(out)
        for new in out.new_requests:
            self.sampling_rows.add(new.request_id, new.sampling_params, new.seed,
                                   new.prompt_token_ids, new.output_token_ids)
            self.prompt_logprobs.add(new.request_id, new.sampling_params,
                                     new.prompt_token_ids, new.output_token_ids)
        rows_of_chunks = self.block_tables.apply(out)
        chunks = out.chunks
        if not chunks:
            return {}, {}, {}
        ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        if pending is not None:
            fill_pending(ids, chunks, pending)
        seq_lens = [c.start_position + c.num_tokens for c in chunks]
        query_lens = [c.num_tokens for c in chunks]
        block_size = self.kv_cache.block_size
        width = -(-max(seq_lens) // block_size)
        # Everything the step works out on the host (its layout, the attention backend's
        # plan, the sampling rows and subsets) goes to the device in one copy, before the
        # forward: on CUDA each input moved on its own was a transfer of its own.
        upload = StepUpload(self.device)
        layout = AttentionMetadata.stage(
            query_lens, seq_lens, self.block_tables.gather(rows_of_chunks, width), block_size,
            upload, input_ids=ids)
        plans = self.attention_backend.stage(query_lens, seq_lens, upload)
        sampling = [i for i, c in enumerate(chunks) if c.sample]
        ids_out = [chunks[i].request_id for i in sampling]
        step = (self.sampling_rows.step(ids_out, [chunks[i].output_index for i in sampling],
                                        upload, self.vocab_size) if sampling else None)
        # The rows whose logits are made: every token (one-token chunks, all sampling: a
        # decode step; the native step makes them with its layers), else the sampling
        # chunks' last tokens; a step that makes prompt logprobs keeps its hidden states
        # (worker/sampling/prompt_logprobs.py).
        plan = self.prompt_logprobs.plan(chunks, upload) if self.prompt_logprobs else None
        picked = (None if plan is not None or not sampling or len(sampling) == len(ids)
                  else upload.add((np.cumsum(query_lens, dtype=np.int64) - 1)[sampling]))
        upload.send()
        meta = layout.metadata()
        meta.backend_plans.update(plans)
        if self.on_forward is not None:
            self.on_forward()
        if plan is not None:  # prompt logprobs: from the hidden states, a block at a time
            hidden = self.model(meta.input_ids, meta.positions, self.kv_cache, meta)
            self._computed(len(ids))
            prompt = self.prompt_logprobs.compute(self.model.compute_logits, hidden, plan)
            if step is None or plan.sample_rows is None:
                return {}, {}, prompt
            logits = self.model.compute_logits(hidden.index_select(0, plan.sample_rows.tensor))
        elif step is None:
            self.model(meta.input_ids, meta.positions, self.kv_cache, meta)
            self._computed(len(ids))
            return {}, {}, {}
        else:
            prompt = {}
            if (self.graphs is not None and picked is None and len(ids) == len(chunks)
                    and len(chunks) <= self.graphs.max_batch):  # a decode step that fits
                logits = self.graphs.run(meta)
            else:
                logits = self.model.logits(meta.input_ids, meta.positions, self.kv_cache,
                                           meta, None if picked is None else picked.tensor)
            self._computed(len(ids))
        # The grammars' masks while the device runs the forward (a CPU's is done by now).
        for k, why in self.sampling_rows.make_masks(step, self.device).items():
            self.grammar_failures[ids_out[k]] = why
        if self.device.type == "cuda":
            # Wait for the forward here, where the wait lets go of the GIL (the sampler's
            # reads of its results would hold it): overlapped steps schedule meanwhile.
            torch.cuda.current_stream(self.device).synchronize()
        tokens, logprobs = self.sampler(logits, step, scratch=True)
        self.sampling_rows.record(step, tokens)
        return (dict(zip(ids_out, tokens, strict=True)),
                dict(zip(ids_out, logprobs, strict=True)), prompt)

    def _computed(self, tokens: int) -> None:
        self.num_forwards += 1
        self.num_computed_tokens += tokens

    def release(self, out: SchedulerOutput) -> None:
        """Give back the rows of the step's finished and preempted requests (also for a step
        that computes nothing: otherwise their rows would stay taken)."""
        for request_id in (*out.finished_ids, *out.preempted_ids):
            self.block_tables.release(request_id)
            self.sampling_rows.release(request_id)
            self.prompt_logprobs.release(request_id)

    def _swap(self, out: SchedulerOutput) -> None:
        """Save preempted KV to the host, then restore swapped-in KV, before the forward."""
        if not (out.swap_out or out.swap_in):
            return
        assert self.host_cache is not None, "the scheduler swapped without a host tier"
        copy_blocks(self.kv_cache, self.host_cache, out.swap_out, self.swap_stream)
        copy_blocks(self.host_cache, self.kv_cache, out.swap_in, self.swap_stream)
        if self.swap_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.swap_stream)


def fill_pending(ids: list[int], chunks: list[ScheduledChunk], sampled: dict[str, int]) -> None:
    """Put in ``ids`` (the step's inputs, chunk after chunk) the token each PENDING_TOKEN
    stands for: a decode's input, which the step before sampled."""
    at = 0
    for chunk in chunks:
        at += len(chunk.token_ids)
        if chunk.token_ids[-1] == PENDING_TOKEN:
            ids[at - 1] = sampled[chunk.request_id]
