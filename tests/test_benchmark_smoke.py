"""Keeps benchmarks/llm_throughput.py from rotting: its workload and transformers peers run on a
toy checkpoint (2 layers, hidden 64) for 3 requests. vllm is never involved; omnistage's engine
only in the last test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` lives at the root

from benchmarks import bandwidth, hf_peers  # noqa: E402
from benchmarks.checkpoint import build_qwen2  # noqa: E402
from benchmarks.workload import make_workload, usable_token_ids  # noqa: E402

@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_qwen2(tmp_path_factory.mktemp("bench") / "qwen2-toy", size="toy", seed=0)


@pytest.fixture(scope="module")
def hf(toy_dir):
    model, pad_id, _ = hf_peers.load_model(toy_dir)
    return model, pad_id


def _small_workload(toy_dir):
    return make_workload(usable_token_ids(toy_dir), 3, seed=0,
                         prompt_lens=(4, 24), output_lens=(3, 9))


def test_workload_is_seeded_and_in_range(toy_dir):
    ids = usable_token_ids(toy_dir)
    a = make_workload(ids, 3, seed=0)
    assert a == make_workload(ids, 3, seed=0)
    assert a != make_workload(ids, 3, seed=1)
    assert all(32 <= len(p) <= 512 for p in a.prompts)
    assert all(16 <= n <= 256 for n in a.output_lens)
    from transformers import AutoTokenizer

    special = set(AutoTokenizer.from_pretrained(toy_dir).all_special_ids)
    assert not special & {t for p in a.prompts for t in p}


def test_hf_peers_count_each_requests_own_tokens(toy_dir, hf):
    model, pad_id = hf
    work = _small_workload(toy_dir)
    one = hf_peers.one_at_a_time(model, pad_id, work)
    assert one.tokens == work.total_output_tokens and one.tok_s > 0
    assert [len(o) for o in one.first_outputs] == work.output_lens[:2]
    sampled = hf_peers.one_at_a_time(model, pad_id, work, sample=2)
    assert sampled.notes["extrapolated"] and sampled.tokens == work.total_output_tokens
    batched = hf_peers.padded_batches(model, pad_id, work, batch_size=2)
    assert batched.tokens == work.total_output_tokens
    assert batched.notes["generated_incl_wasted"] >= work.total_output_tokens
    # Left padding must not change greedy tokens (first token: least sensitive to fp noise).
    assert [o[0] for o in batched.first_outputs] == [o[0] for o in one.first_outputs]
    single = hf_peers.single_stream_decode(model, pad_id, work.prompts[0], 6)
    assert single["tokens"] == 6 and single["decode_tok_s"] > 0


def test_weight_bytes_count_tied_embeddings_once(toy_dir, hf):
    model, _ = hf
    w = bandwidth.weight_bytes(toy_dir)
    assert w["tied_embeddings"]
    assert w["params"] == sum(p.numel() for p in model.parameters())  # shared tensors once
    assert w["bytes"] == 4 * w["params"]
    bw = bandwidth.measure_read_bandwidth(gib=0.02, threads=2, repeats=3)
    assert bandwidth.decode_bound(toy_dir, bw)["bound_tok_s"] > 0


def test_script_prints_one_json_line_last(toy_dir, capsys):
    from benchmarks import llm_throughput

    llm_throughput.main(["--model", str(toy_dir), "--systems", "hf,hf-batch,single",
                         "--num-requests", "3", "--hf-batch-sizes", "2,3",
                         "--prompt-lens", "8,40", "--output-lens", "4,12",
                         "--single-output", "8", "--bandwidth-gib", "0.02"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert not report["errors"]
    assert set(report["systems"]) == {"hf_one_at_a_time", "hf_padded_bs2", "hf_padded_bs3"}
    assert report["hf_padded_best"]["tok_s"] > 0
    assert report["bandwidth"]["bound_tok_s"] > 0 and report["single_stream"]["hf"]


def test_omnistage_runner_on_toy_model(toy_dir):
    from benchmarks import omnistage_runner

    work = _small_workload(toy_dir)
    m = omnistage_runner.throughput(toy_dir, work)
    assert m.tokens == work.total_output_tokens and m.notes["lengths_ok"]


def test_untied_embeddings_count_one_row(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(100, 8), "lm_head.weight": torch.zeros(100, 8),
               "model.norm.weight": torch.zeros(8)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    w = bandwidth.weight_bytes(tmp_path)
    assert not w["tied_embeddings"] and w["params"] == 100 * 8 * 2 + 8
    assert w["bytes"] == 4 * (8 + 100 * 8 + 8)     # one embedding row, all of lm_head, the norm


def test_interleaved_pairs_take_the_median_of_per_pair_ratios():
    from benchmarks.interleave import interleaved
    from benchmarks.workload import Measurement

    order, a_speed, b_speed = [], iter([100, 50, 300, 90]), iter([50, 50, 100, 45])

    def run(name, speeds):
        def one():
            order.append(name)
            tok_s = next(speeds)
            return Measurement(name, tok_s, 1.0)
        return one

    out = interleaved(run("a", a_speed), run("b", b_speed), 4, log=lambda *_: None)
    assert order == ["a", "b"] * 4                          # A B A B, never A A B B
    assert [r["ratio"] for r in out["runs"]] == [2.0, 1.0, 3.0, 2.0]
    assert out["median_ratio"] == 2.0 and out["pairs_measured"] == 4
    assert out["a_best"] == 300 and out["b_best"] == 100
    failed = interleaved(lambda: None, run("b", iter([10, 10, 10])), 3, log=lambda *_: None)
    assert failed["median_ratio"] is None and failed["runs"][0]["ratio"] is None
