"""LLMEngine: requests in, per-step deltas out. `step()` is schedule -> run -> update -> outputs.

Single-threaded by design: AsyncOmni drives it from one engine thread; Omni drives it
directly. Everything a request holds (blocks, detokenizer state) is released when it
finishes or is aborted. Setting up the model side (kernels, KV pool) is `runner_builder`'s
work; turning tokens into text and stop decisions is the `OutputProcessor`'s.
"""

from __future__ import annotations

import logging

import torch

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError
from omnistage.llm.block_manager import BlockManager
from omnistage.llm.input_checks import check_prompt_inputs
from omnistage.llm.model_runner import StepResult
from omnistage.llm.output_processor import OutputProcessor, RequestState
from omnistage.llm.runner_builder import build_runner
from omnistage.llm.scheduler import Scheduler, SchedulerPlan
from omnistage.llm.sequence import EmbedFeed, SeqIdCounter, Sequence
from omnistage.outputs import Delta
from omnistage.sampling_params import SamplingParams
from omnistage.runtime.process import apply_process_options

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer=None,
                 eos_ids: set[int] | None = None):
        """Serve `model` (loaded in its serving dtype on config's device; see
        `omnistage.models.loader.load_text_model`) with `tokenizer` (None: no text, e.g. a
        codec-token stage) and its `eos_ids`."""
        self.config = config
        apply_process_options(config)
        self.device = config.torch_device
        self.model, self.tokenizer = model, tokenizer
        self.dtype = next(model.parameters()).dtype
        self.eos_token_ids = set(eos_ids or ())
        setup = build_runner(config, model, self.eos_token_ids)
        self.runner, self.kv_cache = setup.runner, setup.kv_cache
        self.linear_kernel, self.attention_kernel = setup.linear_kernel, setup.attention_kernel
        self.vocab_size = model.config.vocab_size
        self.max_model_len = self.kv_cache.max_model_len
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_background_tokens)
        self.output = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        log.info("engine ready: %s on %s (%s, %s linear, %s attention), max_model_len %d, "
                 "KV pool %d blocks of %d tokens (%.0f MiB), prefix caching %s", config.model,
                 self.device, str(self.dtype).removeprefix("torch."), self.linear_kernel,
                 self.attention_kernel, self.max_model_len, self.kv_cache.num_blocks,
                 config.block_size, self.runner.kv_cache_bytes / 2**20,
                 "on" if config.enable_prefix_caching else "off")
        self.requests: dict[str, RequestState] = {}
        self.num_aborted_requests = 0
        self.num_steps = 0                  # batches run (steps with work)
        self._seq_ids = SeqIdCounter()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt_embeds: torch.Tensor | None = None,
                    return_hidden_states: bool = False,
                    mrope_positions: torch.Tensor | None = None, position_delta: int = 0,
                    embed_feed: EmbedFeed | None = None,
                    deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
                    background: bool = False) -> None:
        """Queue a request. With `prompt_embeds` (P, input width), those vectors are the
        model's input at the prompt positions and prompt_token_ids are placeholders (length P)
        that penalties still read. `mrope_positions` (3, P) and `position_delta` place a
        multimodal prompt for models with 3-D RoPE; `embed_feed` streams vectors added to the
        inputs of generated positions (steps wait for them); `deepstack` ((V,) prompt
        positions, (K, V, hidden)) adds vectors after the first K layers (models that take it).
        `background`: work no one waits for yet (a Realtime turn prefilled while still spoken):
        its prefill goes in pieces of at most max_background_tokens a step."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if params.n > self.scheduler.max_num_seqs:
            # its samples run side by side from the prompt on: they need n seats at once
            raise InvalidRequestError(f"n={params.n} is more than the {self.scheduler.max_num_seqs} "
                                      f"sequences this engine runs at once (max_num_seqs); ask for "
                                      f"at most {self.scheduler.max_num_seqs}", param="n")
        prompt_token_ids = check_prompt_inputs(prompt_token_ids, prompt_embeds, mrope_positions,
                                               self.model.input_size, self.vocab_size, self.max_model_len)
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq_id = next(self._seq_ids)   # monotonic, so it doubles as the arrival order
            seqs.append(Sequence(seq_id, request_id, i, list(prompt_token_ids),
                                 len(prompt_token_ids), params, prompt_embeds=prompt_embeds,
                                 mrope_positions=mrope_positions, position_delta=position_delta,
                                 embed_feed=embed_feed, deepstack=deepstack, generator=gen,
                                 return_hidden_states=return_hidden_states, arrival=seq_id,
                                 background=background))
        seqs[0].fork_children = seqs[1:]
        self.requests[request_id] = self.output.new_request(request_id, params, seqs)
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> list[Delta]:
        """Stop a request wherever it is and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.num_aborted_requests += 1
        # Collect first: finishing sample 0 before it forked also finishes samples 1..n-1.
        pending = [s for s in req.samples if not s.seq.is_finished]
        out = []
        for s in pending:
            self.scheduler.finish(s.seq, "abort")
            out.append(Delta(request_id, s.seq.index, "", [], finished=True, finish_reason="abort"))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_ready_work(self) -> bool:
        """Whether step() would compute anything now (fed sequences may wait for input)."""
        return self.scheduler.has_ready_work()

    def has_lagging_feed(self) -> bool:
        """Whether a running request waits for its embed feed's next input (a talker's reply
        vector from the thinker)."""
        return self.scheduler.has_lagging_feed()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        result = self.runner.run(plan)
        self.num_steps += 1
        self.scheduler.update(plan)
        return self._outputs(plan, result)

    def _outputs(self, plan: SchedulerPlan, result: StepResult) -> list[Delta]:
        """A delta per sampled token (finished samples leave the scheduler), then one per
        prefill chunk that sampled nothing but carries hidden states."""
        deltas = []
        for st in result.sampled:
            seq = st.seq
            req = self.requests[seq.request_id]
            d = self.output.on_token(req, st, result.hidden_states.pop(seq.seq_id, None))
            d.input_embeds = result.input_embeds.pop(seq.seq_id, None)
            if d.finished:
                self.scheduler.finish(seq, d.finish_reason)
                req.unfinished -= 1
                if req.unfinished == 0:
                    del self.requests[seq.request_id]
            deltas.append(d)
        for chunk in plan.chunks:
            h = result.hidden_states.pop(chunk.seq.seq_id, None)
            if h is not None:
                deltas.append(Delta(chunk.seq.request_id, chunk.seq.index, "", [], hidden_states=h,
                                    input_embeds=result.input_embeds.pop(chunk.seq.seq_id),
                                    num_prompt_tokens=chunk.seq.num_prompt_tokens))
        return deltas

    # ---- state ----------------------------------------------------------------------------
    def num_waiting_requests(self) -> int:
        """Sequences admitted but not yet running (the server's queue bound reads it)."""
        return len(self.scheduler.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def metrics(self, labels: str = "") -> list[tuple[str, str, str, float]]:
        """(name{labels}, kind, help, value) gauges and counters for /metrics."""
        lb = f"{{{labels}}}" if labels else ""
        return [
            (f"omnistage_kv_blocks_total{lb}", "gauge", "KV cache blocks in the pool", self.num_blocks),
            (f"omnistage_kv_blocks_free{lb}", "gauge", "KV cache blocks free", self.num_free_blocks),
            (f"omnistage_requests_running{lb}", "gauge", "sequences holding KV blocks",
             len(self.scheduler.running)),
            (f"omnistage_requests_waiting{lb}", "gauge", "sequences queued or preempted",
             len(self.scheduler.waiting)),
            (f"omnistage_requests_in_engine{lb}", "gauge", "requests the engine holds (any state)",
             len(self.requests)),
            (f"omnistage_preemptions_total{lb}", "counter", "sequences preempted so far",
             self.scheduler.num_preemptions),
            (f"omnistage_requests_aborted_total{lb}", "counter",
             "requests aborted (client gone, or abort())", self.num_aborted_requests),
            (f"omnistage_engine_steps_total{lb}", "counter", "batches the engine ran", self.num_steps),
            (f"omnistage_prefix_cache_hit_tokens_total{lb}", "counter",
             "prompt tokens served by the prefix cache", self.block_manager.num_prefix_hit_tokens),
        ]
