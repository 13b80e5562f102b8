"""Omni: the blocking offline API. All prompts go in at once and share the engine's batches."""

from __future__ import annotations

from omnistage.config import EngineConfig
from omnistage.entrypoints.model_source import resolve_model
from omnistage.entrypoints.prompts import is_single_prompt, new_request_id, params_for, parse_prompt
from omnistage.errors import InvalidRequestError
from omnistage.llm.engine import LLMEngine
from omnistage.outputs import CompletionOutput, OmniOutput


def engine_config(model: str, options: dict) -> EngineConfig:
    unknown = sorted(set(options) - set(EngineConfig.option_names()))
    if unknown:
        raise InvalidRequestError(
            f"unknown engine option(s) {unknown}; valid: {', '.join(EngineConfig.option_names())}",
            param=unknown[0])
    return EngineConfig(model=resolve_model(model), **options)


class Omni:
    """`Omni(model=PATH_OR_tiny:ARCH, **engine options).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **options):
        self.config = engine_config(model, options)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, return_hidden_states: bool = False
                 ) -> list[OmniOutput]:
        """One OmniOutput per prompt, in order. A single prompt still returns a list."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = params_for(sampling_params, len(prompts))
        parsed = [parse_prompt(p, self.engine.tokenizer) for p in prompts]
        outputs: dict[str, OmniOutput] = {}
        try:
            for pp, sp in zip(parsed, params):
                rid = new_request_id()
                self.engine.add_request(rid, pp.token_ids, sp, prompt_embeds=pp.embeds,
                                        return_hidden_states=return_hidden_states)
                outputs[rid] = OmniOutput(rid, pp.text, list(pp.token_ids),
                                          [CompletionOutput(i) for i in range(sp.n)])
            hidden: dict[tuple[str, int], list] = {}
            while self.engine.has_unfinished_requests():
                for d in self.engine.step():
                    out = outputs[d.request_id]
                    out.outputs[d.index].add(d)
                    out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
                    if d.hidden_states is not None:
                        hidden.setdefault((d.request_id, d.index), []).append(d.hidden_states)
        except BaseException:
            for rid in outputs:   # leave the engine clean for the next call
                self.engine.abort_request(rid)
            raise
        if return_hidden_states:
            import torch

            for (rid, i), hs in hidden.items():
                outputs[rid].outputs[i].hidden_states = torch.cat(hs)
        return list(outputs.values())
