"""Omni: the blocking offline API. All prompts go in at once and share the engine's batches."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from omnistage.config import EngineConfig
from omnistage.engine_api import OutputOptions
from omnistage.entrypoints.engines import build_engine
from omnistage.entrypoints.model_source import resolve_model
from omnistage.entrypoints.prompts import is_single_prompt, new_request_id, params_for
from omnistage.errors import InvalidRequestError
from omnistage.graph import failure_error
from omnistage.outputs import CompletionOutput, Delta, OmniOutput
from omnistage.sampling_params import SamplingParams


def engine_config(model: str, options: dict) -> EngineConfig:
    unknown = sorted(set(options) - set(EngineConfig.option_names()))
    if unknown:
        raise InvalidRequestError(
            f"unknown engine option(s) {unknown}; valid: {', '.join(EngineConfig.option_names())}",
            param=unknown[0])
    return EngineConfig(model=resolve_model(model), **options)


class Omni:
    """`Omni(model=PATH_OR_tiny:ARCH, **engine options).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, omni_settings=None, deploy_config=None, **options):
        """`omni_settings` (omni models): an OmniSettings (audio output, vocoder, media limits)."""
        self.config = engine_config(model, options)
        self.engine = build_engine(self.config, omni_settings, deploy_config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop stage processes / actors, if the deploy config started any."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params=None, return_hidden_states: bool = False,
                 use_tqdm: bool = False, output: OutputOptions | None = None) -> list[OmniOutput]:
        """One OmniOutput per prompt, in order. A single prompt still returns a list.
        `sampling_params`: None (defaults), one SamplingParams for all, or one per prompt.
        `use_tqdm` shows a progress bar of finished samples and generated tokens.
        `output` (omni models): modalities, voice, talker sampling; speech lands in
        OmniOutput.audio (float32) at OmniOutput.sample_rate."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"prompts must be one prompt (a string, a dict or a chat message list) or a list "
                f"of prompts, got {type(prompts).__name__}", param="prompt")
        prompts = list(prompts)
        outputs = self._add(prompts, self._params(sampling_params, len(prompts)), return_hidden_states,
                            output or OutputOptions())
        hidden: dict[tuple[str, int], list[torch.Tensor]] = {}
        audio: dict[str, list[np.ndarray]] = {}
        if self.engine.abilities.makes_pixels:
            return self._collect_images(outputs, use_tqdm)
        bar = _progress(sum(len(o.outputs) for o in outputs.values())) if use_tqdm else None
        tokens = 0
        for d in self._drain(outputs):
            if bar is not None:
                tokens += len(d.token_ids)
                bar.set_postfix_str(f"{tokens} tokens", refresh=False)
                bar.update(int(d.finished))
            out = outputs[d.request_id]
            out.outputs[d.index].add(d)
            out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
            if d.hidden_states is not None:
                hidden.setdefault((d.request_id, d.index), []).append(d.hidden_states)
            if d.audio is not None:
                audio.setdefault(d.request_id, []).append(d.audio)
                out.sample_rate = d.sample_rate
        if bar is not None:
            bar.close()
        for rid, chunks in audio.items():
            outputs[rid].audio = np.concatenate(chunks)
        for (rid, i), hs in hidden.items():
            outputs[rid].outputs[i].hidden_states = torch.cat(hs)
        return list(outputs.values())

    def _collect_images(self, outputs: dict[str, OmniOutput], use_tqdm: bool) -> list[OmniOutput]:
        """Image/video models: progress is denoising steps; results land in .images/.pixels."""
        from omnistage.outputs import pil_images

        bar, done = (_progress(0, "denoise", "step") if use_tqdm else None), {}
        for d in self._drain(outputs):
            out = outputs[d.request_id]
            if d.progress is not None:
                done[d.request_id] = d.progress
            if d.finished:                       # the result completes the request's steps
                total = done.get(d.request_id, (0, 0))[1]
                done[d.request_id] = (total, total)
                out.outputs[0].add(d)
                out.pixels, out.seed = d.images, d.seed
                out.images = pil_images(d.images or [])    # layered models: every RGBA layer
            if bar is not None:
                bar.total = sum(t for _, t in done.values())
                bar.n = sum(s for s, _ in done.values())
                bar.refresh()
        if bar is not None:
            bar.close()
        return list(outputs.values())

    def _params(self, sampling_params, count: int) -> list:
        return params_for(sampling_params, count, type(self.engine.default_params()))

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               output: OutputOptions | None = None) -> Iterator[Delta]:
        """Deltas of one prompt as the engine makes them (text deltas; audio chunks in .audio;
        denoising progress and the finished images for image/video models)."""
        yield from self._drain(self._add([prompt], self._params(sampling_params, 1), False,
                                         output or OutputOptions()))

    def _add(self, prompts: list, params: list[SamplingParams], hidden: bool,
             opts: OutputOptions) -> dict[str, OmniOutput]:
        parsed = [self.engine.prepare(p, opts) for p in prompts]  # all checked first
        outputs: dict[str, OmniOutput] = {}
        try:
            for pp, sp in zip(parsed, params):
                rid = new_request_id()
                self.engine.add_request(rid, pp, sp, opts, hidden)
                samples = self.engine.num_samples(sp)   # (an image request's come as one delta)
                outputs[rid] = OmniOutput(rid, pp.text, list(pp.token_ids),
                                          [CompletionOutput(i) for i in range(samples)])
                if self.engine.abilities.makes_pixels:
                    outputs[rid].fps = sp.fps
        except BaseException:
            self._abort(outputs)
            raise
        return outputs

    def _drain(self, outputs: dict[str, OmniOutput]) -> Iterator[Delta]:
        """Step until these requests finish; on any exit before that, abort them."""
        try:
            while any(rid in self.engine.requests for rid in outputs):
                for d in self.engine.step():
                    if d.finish_reason == "error":     # refused (InvalidRequestError) or lost
                        raise failure_error(d)
                    yield d
        finally:
            self._abort(outputs)

    def _abort(self, outputs) -> None:
        for rid in outputs:   # a no-op for finished requests
            self.engine.abort_request(rid)


def _progress(total: int, desc: str = "generate", unit: str = "sample"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
