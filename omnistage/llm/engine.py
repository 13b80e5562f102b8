"""LLMEngine: requests in, per-step deltas out. `step()` is schedule -> run -> update.

Single-threaded by design: AsyncOmni drives it from one engine thread; Omni drives it
directly. Everything a request holds (blocks, detokenizer state) is released when it
finishes or is aborted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.config import EngineConfig
from omnistage.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from omnistage.kernels.build import pick_native
from omnistage.kernels.linear import native_linear_kernel
from omnistage.kernels.paged_attention import PagedAttentionKernel, unsupported_reason
from omnistage.llm.block_manager import BlockManager
from omnistage.llm.detokenizer import IncrementalDetokenizer, find_stop
from omnistage.llm.model_runner import ModelRunner, SampledToken
from omnistage.llm.scheduler import Scheduler
from omnistage.llm.sequence import EmbedFeed, SeqIdCounter, Sequence
from omnistage.models.layers import pack_linears
from omnistage.models.onednn import onednn_linear_available
from omnistage.models.loader import load_model, read_config
from omnistage.outputs import Delta, TokenLogprob
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Sample:
    seq: Sequence
    detok: IncrementalDetokenizer | None     # None when the engine has no tokenizer
    emitted: int = 0           # characters of detok.text already returned


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    samples: list[_Sample]
    hold_chars: int            # text held back while it could still be a stop string's start
    unfinished: int = field(init=False)

    def __post_init__(self) -> None:
        self.unfinished = len(self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None,
                 tokenizer=None, eos_ids: set[int] | None = None):
        """Serve `config.model`, or, when `model` is given (a part of a larger model already
        loaded in config's dtype and device), serve that one with `tokenizer` (None: no text,
        e.g. a codec-token stage) and `eos_ids`."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        if model is None:
            hf_config = read_config(config.model)
            self.dtype = config.torch_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype"))
            self.model = load_model(config.model, self.dtype, self.device)
            self.tokenizer = load_tokenizer(config.tokenizer or config.model)
            self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        else:
            self.dtype = next(model.parameters()).dtype
            self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, set(eos_ids or ())
        self.linear_kernel = self._pack_linears()
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = self._max_model_len()

        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        kernel = self._attention_kernel()
        self.attention_kernel = "torch" if kernel is None else "native"
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype,
                                  self.device, self.eos_token_ids, config.seed, kernel)
        self.runner.keep_prompt_rows = config.enable_prefix_caching
        log.info("engine ready: %s on %s (%s, %s linear, %s attention), max_model_len %d, "
                 "KV pool %d blocks of %d tokens (%.0f MiB), prefix caching %s", config.model,
                 self.device, str(self.dtype).removeprefix("torch."), self.linear_kernel,
                 self.attention_kernel, self.max_model_len,
                 num_blocks, config.block_size, self.runner.kv_cache_bytes / 2**20,
                 "on" if config.enable_prefix_caching else "off")
        self.requests: dict[str, _Request] = {}
        self.num_aborted_requests = 0
        self._seq_ids = SeqIdCounter()

    def _pack_linears(self) -> str:
        """Choose the linear kernel: ours where it serves and builds, else oneDNN's packed GEMM
        where it serves, else matmul. An explicit choice that cannot serve is an error."""
        want = self.config.linear_kernel
        if want == "matmul":
            return "matmul"
        if want in ("auto", "native"):
            kernel, why = native_linear_kernel(want, self.device, self.dtype)
            if kernel is not None:
                pack_linears(self.model, kernel)
                return "native"
            log.info("linear layers without the native kernel: %s", why)
        if onednn_linear_available(self.device, self.dtype):
            pack_linears(self.model, None)
            return "onednn"
        if want == "onednn":
            raise InvalidRequestError(
                "linear_kernel=onednn needs float32 on a CPU with a oneDNN-enabled torch build; "
                "use auto or matmul", param="linear_kernel")
        return "matmul"

    def _attention_kernel(self) -> PagedAttentionKernel | None:
        """The native attention kernels where they serve (built on first use), else None: the
        PyTorch path. `auto` falls back (and logs why) when they do not serve or build."""
        want = self.config.attention_kernel
        if want == "torch":
            return None
        _, kv_heads, head_dim = self.model.kv_shape
        heads = self.model.config.num_attention_heads
        kernel, why = pick_native(
            "attention_kernel", want,
            unsupported_reason(self.device, self.dtype, heads, kv_heads, head_dim, self.config.block_size),
            lambda: PagedAttentionKernel(heads, kv_heads, head_dim, self.config.block_size),
            "auto or torch")
        if kernel is None:
            log.info("attention in PyTorch: the native kernels do not serve here (%s)", why)
        return kernel

    # ---- sizing ---------------------------------------------------------------------------
    def _max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        want = self.config.max_model_len or limit
        if want > limit:
            raise InvalidRequestError(
                f"max_model_len {want} exceeds the model's max_position_embeddings {limit}",
                param="max_model_len")
        return want

    def _num_kv_blocks(self) -> int:
        bs = self.config.block_size
        layers, kv_heads, head_dim = self.model.kv_shape
        block_bytes = 2 * layers * kv_heads * head_dim * bs * torch.empty((), dtype=self.dtype).element_size()
        one_seq = -(-self.max_model_len // bs) + 1   # +1: a copy-on-write spare
        if self.config.num_kv_blocks is not None:
            n = self.config.num_kv_blocks
        else:
            # Enough for every seat filled to the full context, within the memory cap.
            full = self.config.max_num_seqs * -(-self.max_model_len // bs) + 1
            n = min(full, int(self.config.kv_cache_memory_gb * 2**30) // block_bytes)
        if n < one_seq:
            raise InvalidRequestError(
                f"the KV pool ({n} blocks of {bs} tokens) cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens; raise kv_cache_memory_gb / "
                f"num_kv_blocks to at least {one_seq} blocks or lower max_model_len",
                param="num_kv_blocks")
        return n

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt_embeds: torch.Tensor | None = None,
                    return_hidden_states: bool = False,
                    mrope_positions: torch.Tensor | None = None, position_delta: int = 0,
                    embed_feed: EmbedFeed | None = None) -> None:
        """Queue a request. With `prompt_embeds` (P, input width), those vectors are the
        model's input at the prompt positions and prompt_token_ids are placeholders (length P)
        that penalties still read. `mrope_positions` (3, P) and `position_delta` place a
        multimodal prompt for models with 3-D RoPE; `embed_feed` streams vectors added to the
        inputs of generated positions (steps wait for them)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        width = self.model.input_size
        if prompt_embeds is not None:
            if prompt_embeds.dim() != 2 or prompt_embeds.shape[1] != width:
                raise InvalidRequestError(
                    f"prompt_embeds must have shape (num_tokens, {width}), "
                    f"got {tuple(prompt_embeds.shape)}", param="prompt_embeds")
            if not prompt_token_ids:
                prompt_token_ids = [0] * prompt_embeds.shape[0]
            elif len(prompt_token_ids) != prompt_embeds.shape[0]:
                raise InvalidRequestError(
                    f"prompt_token_ids ({len(prompt_token_ids)}) and prompt_embeds "
                    f"({prompt_embeds.shape[0]} rows) must have the same length", param="prompt_embeds")
        if mrope_positions is not None and tuple(mrope_positions.shape) != (3, len(prompt_token_ids)):
            raise InvalidRequestError(f"mrope_positions must have shape (3, {len(prompt_token_ids)}), "
                                      f"got {tuple(mrope_positions.shape)}", param="mrope_positions")
        self._check_prompt(prompt_token_ids, prompt_embeds)
        samples = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq_id = next(self._seq_ids)   # monotonic, so it doubles as the arrival order
            seq = Sequence(seq_id, request_id, i, list(prompt_token_ids),
                           len(prompt_token_ids), params, prompt_embeds=prompt_embeds,
                           mrope_positions=mrope_positions, position_delta=position_delta,
                           embed_feed=embed_feed, generator=gen,
                           return_hidden_states=return_hidden_states, arrival=seq_id)
            det = None
            if self.tokenizer is not None:
                det = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            samples.append(_Sample(seq, det))
        head = samples[0].seq
        head.fork_children = [s.seq for s in samples[1:]]
        hold = max((len(s) for s in params.stop), default=1) - 1
        self.requests[request_id] = _Request(request_id, params, samples, hold)
        self.scheduler.add(head)

    def _check_prompt(self, ids: list[int], embeds: torch.Tensor | None) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, "
                f"which must leave room for at least one generated token; shorten the prompt",
                param="prompt")
        if embeds is None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(
                f"prompt token ids must lie in [0, {self.vocab_size}); got one outside", param="prompt")

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

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Delta]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        result = self.runner.run(plan)
        self.scheduler.update(plan)
        deltas = []
        for st in result.sampled:
            d = self._on_token(st, result.hidden_states.pop(st.seq.seq_id, None))
            d.input_embeds = result.input_embeds.pop(st.seq.seq_id, None)
            deltas.append(d)
        for chunk in plan.chunks:   # prefill chunks that sampled nothing but carry hidden states
            h = result.hidden_states.pop(chunk.seq.seq_id, None)
            if h is not None:
                deltas.append(Delta(chunk.seq.request_id, chunk.seq.index, "", [], hidden_states=h,
                                    input_embeds=result.input_embeds.pop(chunk.seq.seq_id),
                                    num_prompt_tokens=chunk.seq.num_prompt_tokens))
        return deltas

    def _on_token(self, st: SampledToken, hidden: torch.Tensor | None) -> Delta:
        seq, tok = st.seq, st.token_id
        req = self.requests[seq.request_id]
        sample = req.samples[seq.index]
        seq.token_ids.append(tok)
        detok = sample.detok
        before = len(detok.text) if detok else 0
        if detok:
            detok.push([tok])
        text = detok.text if detok else ""
        reason, stop_reason, end = self._check_stop(seq, tok, text, len(text) - before)
        if reason is None:
            end = max(sample.emitted, len(text) - req.hold_chars)
        elif not isinstance(stop_reason, str) and detok:   # ended by a token: release held-back bytes
            detok.flush()
            text = detok.text
            end = len(text)
        delta = Delta(seq.request_id, seq.index, text[sample.emitted:end], [tok],
                      hidden_states=hidden, num_prompt_tokens=seq.num_prompt_tokens,
                      num_cached_tokens=seq.num_cached_tokens)
        sample.emitted = end
        if st.logprob is not None:
            delta.logprobs = [TokenLogprob(tok, st.logprob, st.top_logprobs or [])]
        if reason is not None:
            delta.finished, delta.finish_reason, delta.stop_reason = True, reason, stop_reason
            self.scheduler.finish(seq, reason)
            req.unfinished -= 1
            if req.unfinished == 0:
                del self.requests[seq.request_id]
        return delta

    def _check_stop(self, seq: Sequence, tok: int, text: str, num_new_chars: int):
        """-> (finish_reason or None, stop_reason, end of the text to keep)."""
        p = seq.params
        if p.stop:
            hit = find_stop(text, num_new_chars, p.stop)
            if hit is not None:
                s, idx = hit
                return "stop", s, idx + (len(s) if p.include_stop_str_in_output else 0)
        if p.forced_token_ids:     # a forced sample ends with its last forced token
            if seq.num_output_tokens >= len(p.forced_token_ids):
                return "stop", None, len(text)
            if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) \
                    or seq.num_tokens >= self.max_model_len:
                return "length", None, len(text)
            return None, None, 0
        if tok in self.eos_token_ids and not p.ignore_eos:
            return "stop", None, len(text)
        if tok in p.stop_token_ids:
            return "stop", tok, len(text)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None, len(text)
        if seq.num_tokens >= self.max_model_len:
            return "length", None, len(text)
        return None, None, 0

    def close(self) -> None:
        """Nothing to release beyond memory (for the same interface as stage pipelines)."""

    def num_waiting_requests(self) -> int:
        """Sequences admitted but not yet running (the server's queue bound reads it)."""
        return len(self.scheduler.waiting)

    def health(self) -> str | None:
        """None when healthy, else why not."""
        return None

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
            (f"omnistage_prefix_cache_hit_tokens_total{lb}", "counter",
             "prompt tokens served by the prefix cache", self.block_manager.num_prefix_hit_tokens),
        ]

    # ---- stats ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path} ({e}); the folder needs "
                             f"tokenizer.json / tokenizer_config.json") from e
    if len(tokenizer) < 2:  # transformers builds an empty one when the files are missing
        raise ModelLoadError(f"no tokenizer vocabulary in {path}; the folder needs "
                             f"tokenizer.json / tokenizer_config.json (or pass tokenizer=FOLDER)")
    return tokenizer


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen} is not valid JSON ({e})") from e
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids |= {int(x) for x in eos}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
