"""The transformers side of benchmarks/omni_e2e.py for Qwen3-Omni: `Qwen3OmniMoeForConditionalGeneration
.generate` with audio, one request at a time, in the subprocess that benchmarks/omni_peers.py
starts (`HFJob(family="qwen3_omni")`).

Each request: the chat messages rendered with the folder's chat template (Qwen3-Omni has no
default system turn, and omnistage's pipeline adds none), greedy thinker forced to exactly
`text_tokens` (thinker_min_new_tokens = thinker_max_new_tokens; the folder's EOS ids from
generation_config.json, so both sides ban the same ids), greedy talker (and code predictor)
forced to exactly `codec_tokens` frames: talker_min_new_tokens = talker_max_new_tokens =
frames + 1, as the talker's last code gets no frame; the folder's repetition penalty; the
first voice by name (omnistage's default). code2wav as generate calls it (chunked_decode,
300-frame chunks, 25 frames of left context).

The 16-codebook frames each request's code2wav received are read by a forward hook on
`model.code2wav` (its windows, the left context dropped: `frames_from_windows`), as
tests/models/qwen3_omni/test_qwen3_omni_parity.py reads them; omni_e2e reads omnistage's the
same way on the code2wav stage's model.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SAMPLE_RATE = 24000          # code2wav's output rate
HF_LEFT_CONTEXT = 25         # generate()'s chunked_decode(left_context_size=25)


def frames_from_windows(windows: list, left_context: int) -> list[list[int]] | None:
    """The (Q, F) frames a code2wav decoded, from its forward inputs (1, Q, context + chunk) in
    order: each window's first min(left_context, frames so far) frames are context. None if a
    forward held several requests (B > 1): rows cannot be told apart."""
    import torch

    if any(w.shape[0] != 1 for w in windows):
        return None
    pieces, done = [], 0
    for w in windows:
        new = w[0, :, min(left_context, done):]
        pieces.append(new)
        done += new.shape[1]
    return torch.cat(pieces, dim=1).tolist() if pieces else []


def talker_settings(model_dir: str | Path, frames: int) -> dict:
    """Greedy thinker/talker kwargs of generate(): `frames` frames, the folder's EOS ids and
    talker repetition penalty (generate does not read them from generation_config.json)."""
    gen_file = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return {"thinker_do_sample": False, "thinker_eos_token_id": gen.get("eos_token_id"),
            "talker_do_sample": False, "talker_max_new_tokens": frames + 1,
            "talker_min_new_tokens": frames + 1,
            "talker_repetition_penalty": gen.get("talker_repetition_penalty", 1.05)}


def _time_parts(model) -> dict[str, float]:
    """A dict that forward hooks keep filling with each part's summed forward seconds (the
    code predictor runs from the talker's prepare_inputs_for_generation, outside its forward)."""
    parts = {"thinker": model.thinker, "talker": model.talker,
             "code_predictor": model.talker.code_predictor, "code2wav": model.code2wav}
    spent, started = dict.fromkeys(parts, 0.0), {}

    def stop(name: str) -> None:
        spent[name] += time.perf_counter() - started.pop(name)

    for name, module in parts.items():
        module.register_forward_pre_hook(lambda *_, n=name: started.__setitem__(n, time.perf_counter()))
        module.register_forward_hook(lambda *_, n=name: stop(n))
    return spent


def _generator(model, tok, settings: dict, speaker: str):
    """generate(messages, text_tokens, frames) -> (new text tokens, audio seconds, frames)."""
    import torch

    windows: list = []
    model.code2wav.register_forward_hook(lambda m, args, out: windows.append(args[0].clone()))

    @torch.inference_mode()
    def generate(messages, text_tokens: int, frames: int):
        windows.clear()
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        kw = {**settings, "talker_max_new_tokens": frames + 1, "talker_min_new_tokens": frames + 1}
        seq, wav = model.generate(ids, speaker=speaker, thinker_max_new_tokens=text_tokens,
                                  thinker_min_new_tokens=text_tokens, **kw)
        return (seq[0, ids.shape[1]:].tolist(), wav.reshape(-1).numel() / SAMPLE_RATE,
                frames_from_windows(windows, HF_LEFT_CONTEXT))
    return generate


def run_job(job):
    """omni_jobs.HFJob -> omni_jobs.HFResult (codes: per request, its (16, F) frames)."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from benchmarks.omni_jobs import HFResult
    from omnistage.models.qwen3_omni.loader import voice_order

    if job.threads:
        torch.set_num_threads(job.threads)
    t0 = time.perf_counter()
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(job.model_dir,
                                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(job.model_dir)
    speaker = voice_order(model.config.talker_config.speaker_id)[0]   # omnistage's default voice
    settings = talker_settings(job.model_dir, job.codec_tokens)
    generate = _generator(model, tok, settings, speaker)
    generate([{"role": "user", "content": "Warm up."}], 4, 8)    # not timed
    res = HFResult(time.perf_counter() - t0, [], [], [], [], torch.get_num_threads(),
                   {**settings, "speaker": speaker}, _time_parts(model))
    for messages in job.messages:
        t = time.perf_counter()
        tokens, audio_s, frames = generate(messages, job.text_tokens, job.codec_tokens)
        res.latency_s.append(time.perf_counter() - t)
        res.audio_s.append(audio_s)
        res.text_token_ids.append(tokens)
        res.codes.append(frames)
        print(f"[hf] request {len(res.latency_s)}/{len(job.messages)}: {res.latency_s[-1]:.2f} s, "
              f"{audio_s:.3f} s of audio, {len(tokens)} text tokens, "
              f"{len(frames[0]) if frames else 0} frames", file=sys.stderr, flush=True)
    return res
