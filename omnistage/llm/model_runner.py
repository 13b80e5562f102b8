"""Turns a scheduler plan into flat batch tensors, runs the model over the paged KV caches,
and samples the next token of every sequence whose chunk reached its end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.kernels.paged_attention import PagedAttentionKernel
from omnistage.layers.attention import (AttentionMetadata, DecodeGroup, KVCache, NativeBatches,
                                        PrefillSpan)
from omnistage.llm.model_output import LMOutput
from omnistage.llm.sampler import GreedyChooser, RowArgmax, Sampler, SamplingBatch, TopKRace, torch_argmax
from omnistage.llm.scheduler import ScheduledChunk, SchedulerPlan
from omnistage.llm.sequence import Sequence
from omnistage.sampling_params import SamplingParams

SUPPRESS_CACHE_SIZE = 256       # banned-id tensors kept (ModelRunner._banned)


@dataclass
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass
class StepResult:
    sampled: list[SampledToken]
    # seq_id -> (num_new_tokens, hidden) final-normed hidden states of the positions
    # computed this step, for sequences that asked for them.
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # seq_id -> (num_new_tokens, input width): the vectors that entered layer 0 there.
    input_embeds: dict[int, torch.Tensor] = field(default_factory=dict)


def _is_decode(c: ScheduledChunk) -> bool:
    """One generated position. A one-token chunk of a prompt is attended as a prefill chunk,
    so a prompt's rows come out the same however the scheduler splits it."""
    return c.num_new_tokens == 1 and c.start >= c.seq.num_prompt_tokens


def _padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as rows of equal width, padded with block 0 (never read past a context)."""
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, eos_token_ids: set[int], seed: int = 0,
                 kernel: PagedAttentionKernel | None = None, kv_dtype: torch.dtype | None = None,
                 argmax: RowArgmax = torch_argmax, greedy: GreedyChooser | None = None,
                 race: TopKRace | None = None):
        self.model = model
        # Native attention (two calls per layer, blocks read in place), or None: the PyTorch
        # path, which gathers contexts.
        self.kernel = kernel
        self.device = device
        self.block_size = block_size
        num_layers, num_kv_heads, head_dim = model.kv_shape
        # K and V are stored in kv_dtype (default: the model's); attention computes in dtype.
        self.kv_dtype = kv_dtype or dtype
        self.caches = [KVCache(num_kv_heads, num_blocks, block_size, head_dim, self.kv_dtype, device)
                       for _ in range(num_layers)]
        self.dtype = dtype
        self._gather_buffer: torch.Tensor | None = None
        self.eos_token_ids = set(eos_token_ids)
        self.sampler = Sampler(seed, argmax=argmax, greedy=greedy, race=race)
        self._suppress_cache: dict[tuple[int, bool], tuple[tuple, torch.Tensor]] = {}   # _banned
        # Prefix caching on: sequences that return hidden states keep their prompt rows until
        # their blocks are stored (a later request that reuses the blocks needs them).
        self.keep_prompt_rows = False

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.kv.numel() * c.kv.element_size() for c in self.caches)

    @torch.inference_mode()
    def run(self, plan: SchedulerPlan) -> StepResult:
        for src, dst in plan.block_copies:
            for cache in self.caches:
                cache.copy_block(src, dst)
        # Decodes first, shortest context first: neighbours share batched attention calls
        # with little padding.
        chunks = sorted(plan.chunks, key=lambda c: (not _is_decode(c), c.start))
        ids, positions, meta, rows = self._prepare(chunks)
        embeds = self.model.embed(ids)
        self._overlay_prompt_embeds(chunks, rows, embeds)
        self._add_embed_feeds(chunks, rows, embeds)
        if self.model.position_dims == 3:
            positions = self._mrope_positions(chunks, positions)
        sample_chunks = [c for c, (_, r1) in zip(chunks, rows) if c.sample]
        sample_rows = torch.tensor([r1 - 1 for c, (_, r1) in zip(chunks, rows) if c.sample],
                                   dtype=torch.int64, device=self.device)
        # Only the sampled rows leave the model, unless a sequence wants its hidden states
        # (then all do) or every row samples anyway (a decode-only step).
        prune = len(sample_chunks) < len(ids) and not any(c.seq.return_hidden_states for c in chunks)
        deepstack = self._deepstack(chunks, rows)    # only models that take it ever get it
        out = self.model(embeds, positions, self.caches, meta, sample_rows if prune else None,
                         **({"deepstack": deepstack} if deepstack is not None else {}))
        # A model may hand out other states than the ones it samples from (LMOutput).
        hidden, exported = (out.final, out.exported) if isinstance(out, LMOutput) else (out, out)

        result = StepResult(sampled=[])
        for chunk, (r0, r1) in zip(chunks, rows):
            seq = chunk.seq
            if not seq.return_hidden_states:
                continue
            if self.keep_prompt_rows:
                seq.keep_rows(chunk.start, exported[r0:r1], embeds[r0:r1])
            # Each position's hidden state goes out once, even when a preempted sequence
            # computes it again.
            skip = max(0, seq.num_hidden_emitted - chunk.start)
            if r0 + skip < r1:
                h, e = exported[r0 + skip:r1], embeds[r0 + skip:r1]
                if seq.num_hidden_emitted < chunk.start:   # served by the prefix cache
                    ch, ce = seq.cached_rows
                    h = torch.cat([ch[seq.num_hidden_emitted:chunk.start], h])
                    e = torch.cat([ce[seq.num_hidden_emitted:chunk.start], e])
                result.hidden_states[seq.seq_id] = h
                result.input_embeds[seq.seq_id] = e
                seq.num_hidden_emitted = chunk.start + chunk.num_new_tokens
        if sample_chunks:
            result.sampled = self._sample(hidden if prune else hidden.index_select(0, sample_rows),
                                          sample_chunks)
        return result

    # ---- inputs ---------------------------------------------------------------------------
    def _prepare(self, chunks: list[ScheduledChunk]):
        """Flat inputs for `chunks`, which must list decodes first, ordered by
        context length (see run)."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[tuple[int, int]] = []
        decode_tables: list[list[int]] = []
        prefill_tables: list[list[int]] = []
        spans: list[tuple[int, int, int]] = []          # (first row, query tokens, context)
        for c in chunks:
            seq, start, n = c.seq, c.start, c.num_new_tokens
            r0 = len(ids)
            rows.append((r0, r0 + n))
            ids += seq.token_ids[start:start + n]
            table = seq.block_table
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            ctx_blocks = table[:-(-(start + n) // bs)]
            if _is_decode(c):
                decode_tables.append(ctx_blocks)
            else:
                prefill_tables.append(ctx_blocks)
                spans.append((r0, n, start + n))
        lens = [pos[r0] + 1 for r0, _ in rows[:len(decode_tables)]]
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        if self.kernel is not None:
            def i64(x) -> torch.Tensor:
                return torch.tensor(x, dtype=torch.int64, device=dev)
            s0, n, ctx = zip(*spans) if spans else ((), (), ())
            meta = AttentionMetadata(slot_mapping, decodes=[], prefills=[], native=NativeBatches(
                self.kernel, i64(_padded(decode_tables)), i64(lens), i64(_padded(prefill_tables)),
                i64(s0), i64(n), i64(ctx)))
        else:
            decodes = self._decode_groups(decode_tables, lens)
            prefills = [PrefillSpan(r0, n, ctx, None if ctx == n else torch.tensor(t, device=dev))
                        for (r0, n, ctx), t in zip(spans, prefill_tables)]
            gathered = [g.block_tables.numel() for g in decodes]
            gathered += [p.block_table.numel() for p in prefills if p.block_table is not None]
            meta = AttentionMetadata(slot_mapping, decodes=decodes, prefills=prefills,
                                     workspace=self._workspace(max(gathered, default=0)))
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev), meta, rows)

    def _workspace(self, num_blocks: int) -> torch.Tensor | None:
        """The gather buffer, grown (never shrunk) to hold `num_blocks` blocks of K and V."""
        need = self.caches[0].gather_numel(num_blocks)
        if need == 0:
            return None
        if self._gather_buffer is None or self._gather_buffer.numel() < need:
            self._gather_buffer = torch.empty(need, dtype=self.kv_dtype, device=self.device)
        return self._gather_buffer

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decodes (sorted by length) into groups whose padding wastes little: a group
        grows while its padded size stays within 1/0.8 of its real size."""
        groups, start = [], 0
        while start < len(tables):
            end = start + 1
            while end < len(tables) and sum(lens[start:end + 1]) >= 0.8 * (end + 1 - start) * lens[end]:
                end += 1
            groups.append(self._decode_group(start, tables[start:end], lens[start:end]))
            start = end
        return groups

    def _decode_group(self, row_start: int, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        dev, width, b = self.device, max(len(t) for t in tables), len(tables)
        flat = torch.tensor([i for t in tables for i in t + [0] * (width - len(t))], device=dev)
        key_pos = torch.arange(width * self.block_size, device=dev).unsqueeze(0)
        past = key_pos >= torch.tensor(lens, device=dev).unsqueeze(1)            # (B, L)
        bias = torch.zeros(past.shape, dtype=self.dtype, device=dev).masked_fill_(past, float("-inf"))
        num_kv_heads = self.caches[0].kv.shape[1]
        bias = bias.unsqueeze(1).repeat(num_kv_heads, 1, 1)                     # (Hkv B, 1, L)
        return DecodeGroup(row_start, flat, bias, b)

    def _deepstack(self, chunks, rows) -> tuple[torch.Tensor, torch.Tensor] | None:
        """((R,) flat-batch rows, (K, R, hidden)) of the DeepStack vectors whose prompt
        positions this step computes; None when there are none."""
        flat_rows, vectors = [], []
        for c, (r0, _) in zip(chunks, rows):
            ds = c.seq.deepstack
            if ds is None or c.start >= c.seq.num_prompt_tokens:
                continue
            where = (ds[0] >= c.start) & (ds[0] < c.start + c.num_new_tokens)
            if where.any():
                flat_rows.append(ds[0][where] - c.start + r0)
                vectors.append(ds[1][:, where])
        if not flat_rows:
            return None
        return torch.cat(flat_rows).to(self.device), torch.cat(vectors, dim=1).to(self.device)

    def _overlay_prompt_embeds(self, chunks, rows, embeds: torch.Tensor) -> None:
        """Positions inside an embeddings prompt take the given vectors, not token embeddings."""
        for c, (r0, _) in zip(chunks, rows):
            pe = c.seq.prompt_embeds
            if pe is None or c.start >= c.seq.num_prompt_tokens:
                continue
            end = min(c.start + c.num_new_tokens, c.seq.num_prompt_tokens)
            embeds[r0:r0 + end - c.start] = pe[c.start:end].to(embeds.device, embeds.dtype)

    def _add_embed_feeds(self, chunks, rows, embeds: torch.Tensor) -> None:
        """Generated positions of a fed sequence add the feed's vector to their embedding."""
        for c, (r0, _) in zip(chunks, rows):
            feed, p0 = c.seq.embed_feed, c.seq.num_prompt_tokens
            if feed is None:
                continue
            first = max(c.start, p0)
            for p in range(first, c.start + c.num_new_tokens):
                embeds[r0 + p - c.start] += feed[p - p0].to(embeds.device, embeds.dtype)

    def _mrope_positions(self, chunks, flat: torch.Tensor) -> torch.Tensor:
        """(3, T) positions: a prompt's own 3-D positions where it has them, else the text
        position p + position_delta on all three axes (plain prompts have delta 0)."""
        out = flat.unsqueeze(0).repeat(3, 1)
        r0 = 0
        for c in chunks:
            seq, n = c.seq, c.num_new_tokens
            if seq.position_delta:
                out[:, r0:r0 + n] += seq.position_delta
            mp = seq.mrope_positions
            if mp is not None and c.start < seq.num_prompt_tokens:
                end = min(c.start + n, seq.num_prompt_tokens)
                out[:, r0:r0 + end - c.start] = mp[:, c.start:end].to(out.device)
            r0 += n
        return out

    # ---- sampling -------------------------------------------------------------------------
    def _sample(self, hidden: torch.Tensor, sample_chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """hidden: (S, hidden) the last row of each chunk in `sample_chunks`."""
        logits = self.model.compute_logits(hidden)                 # (S, V)
        seqs: list[Sequence] = []
        expand: list[int] = []
        for i, chunk in enumerate(sample_chunks):
            for s in [chunk.seq, *chunk.forks]:   # forked samples draw from the same logits
                seqs.append(s)
                expand.append(i)
        if len(expand) != len(sample_chunks):
            logits = logits[torch.tensor(expand, device=self.device)]
        out = self.sampler(logits, self._batch(seqs))
        tokens = out.token_ids.tolist()
        for i, s in enumerate(seqs):
            forced = s.params.forced_token_ids
            if s.num_output_tokens < len(forced):
                tokens[i] = forced[s.num_output_tokens]
        sampled = [SampledToken(s, t) for s, t in zip(seqs, tokens)]
        if out.logprobs is not None:
            lp = out.logprobs.tolist()
            top_ids, top_lp = out.top_token_ids.tolist(), out.top_logprobs.tolist()
            for i, st in enumerate(sampled):
                k = st.seq.params.logprobs
                if k is not None and not st.seq.params.forced_token_ids:
                    st.logprob = lp[i]
                    st.top_logprobs = list(zip(top_ids[i][:k], top_lp[i][:k]))
        return sampled

    def _banned(self, params: SamplingParams, before_min: bool) -> torch.Tensor | list[int]:
        """A request's banned ids as a tensor, made once per params object (params are not
        changed once submitted): its suppress_token_ids, and before min_tokens also the EOS and
        stop ids. A talker's hold ~1000 codec ids: converting them (and, before min_tokens,
        merging them with the stops as sorted sets) cost ~0.15 ms a row at every step. Found
        by the object's identity (and its lists': a list assigned anew is converted anew); the
        cache holds them, so no identity is reused while cached."""
        if not params.suppress_token_ids and not before_min:
            return []
        key = (id(params), before_min)
        lists = (params, params.suppress_token_ids, params.stop_token_ids)
        hit = self._suppress_cache.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], lists)):
            if len(self._suppress_cache) >= SUPPRESS_CACHE_SIZE:
                self._suppress_cache.clear()
            ids = set(params.suppress_token_ids)
            if before_min:
                ids |= self.eos_token_ids | set(params.stop_token_ids)
            hit = self._suppress_cache[key] = (lists, torch.tensor(sorted(ids), dtype=torch.long,
                                                                   device=self.device))
        return hit[1]

    def _batch(self, seqs: list[Sequence]) -> SamplingBatch:
        # Forked samples have not appended their first token yet: count from the prompt.
        banned = [self._banned(s.params, s.num_output_tokens < s.params.min_tokens) for s in seqs]
        return SamplingBatch(
            params=[s.params for s in seqs],
            generators=[s.generator for s in seqs],
            # Token lists cost a copy per row: build them only where penalties read them.
            prompt_token_ids=[s.prompt_token_ids if s.params.uses_penalties else [] for s in seqs],
            output_token_ids=[s.output_token_ids if s.params.uses_penalties else [] for s in seqs],
            banned_token_ids=banned)
