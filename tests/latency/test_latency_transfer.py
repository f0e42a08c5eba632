"""The transferred latency model (simulator/latency/transfer.py): its terms by hand on a tiny model,
a fit that recovers known coefficients from records made with them, transfer to another GPU by the
spec sheets' ratios, the overlapped view, the coefficients file, and its selection where no fitted
profile matches (with its label and its leave-one-out band)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

import traces
from engine.model_spec import ModelSpec
from simulator.band import band_errors, profile_band_errors
from simulator.config import SimConfig
from simulator.defaults import SHIPPED_PROFILE_DIR, TRANSFER_MODEL, default_latency_file
from simulator.latency import RooflineModel, SplitKV, StepShape
from simulator.latency.profile import load_latency_model
from simulator.latency.transfer import (
    DECODE_TERMS,
    FLOOR_KINDS,
    PREFILL_TERMS,
    Pinned,
    RecordSet,
    StepPhysics,
    TransferCoefficients,
    TransferredModel,
    decode_terms,
    fit_transfer,
    is_transfer_file,
    prefill_terms,
)
from simulator.run import latency_label, load_latency, run_simulation
from simulator.sweep import profile_for

H200_BW, H200_PEAK = 4.8e12, 989.4e12
PINNED = Pinned.of_gpu("H200")  # 4.25 of 4.8 TB/s, 797 of 989.4 TFLOP/s
UNBALANCED = SplitKV(num_kv_heads=2, num_sms=132)


def tiny(layers: int = 2) -> ModelSpec:
    return ModelSpec(
        name=f"tiny-{layers}",
        architecture="Qwen3ForCausalLM",
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=1e6,
    )


KNOWN = TransferCoefficients(
    decode={
        "host_step": 3.0e-4,
        "host_row": 5.0e-6,
        "host_entry": 2.0e-8,
        "layer": 2.0e-5,
        "multi_row_layer": 1.5e-5,
        "kv_read": 1.1,
        "longest_split": 2.0,
    },
    prefill={
        "host_step": 1.0e-3,
        "host_seq": 1.2e-5,
        "host_entry": 3.0e-8,
        "layer": 1.0e-4,
        "activation": 80.0,
        "attention": 1.5,
        "kv_read": 1.3,
    },
    floors={"prefill": 0.0, "mixed": 0.0},
    pinned=PINNED,
    reference_gpu="H200-SXM",
)


def test_physics_of_a_tiny_model_by_hand():
    p = StepPhysics.of(tiny(), "h200", 1, 16, PINNED, num_sms=132)
    # params: 2 layers x (attention 3,072 + MLP 6,144 + norms 80) + tied embedding 3,200 + final norm 32
    params = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 + 2 * 8) + 100 * 32 + 32
    assert params == 21_824
    assert p.weight_s == pytest.approx(2 * params / 4.25e12, rel=1e-12)
    assert p.token_flops_s == pytest.approx(2 * (params - 3_200) / 797e12, rel=1e-12)
    assert p.seq_flops_s == pytest.approx(2 * 3_200 / 797e12, rel=1e-12)
    kv_token = 2 * 2 * 2 * 8 * 2  # k and v, 2 layers, 2 kv heads, head_dim 8, 2 bytes
    assert p.kv_token_s == pytest.approx(kv_token / H200_BW, rel=1e-12)
    assert p.split_token_s == pytest.approx(2 * (2 * 8 * 2) * 132 / H200_BW, rel=1e-12)
    assert p.activation_token_s == pytest.approx(2 * 32 * 2 / H200_BW, rel=1e-12)
    assert p.pair_s == pytest.approx(4 * 8 * 4 * 2 / H200_PEAK, rel=1e-12)
    assert (p.comm_fixed_s, p.comm_token_s) == (0.0, 0.0)  # tp 1


def test_decode_and_prefill_terms_and_step_times_by_hand():
    p = StepPhysics.of(tiny(), "h200", 1, 16, PINNED, num_sms=132)
    # 4 rows, 100 cached tokens, the longest 40: 32 splits (2 kv heads x 4 rows on 132 SMs, capped)
    terms = decode_terms(p, UNBALANCED, 4, 100, 40, sync=True)
    assert terms == pytest.approx(
        {
            "host_step": 1.0,
            "host_row": 4.0,
            "host_entry": 4 * 40 / 16,
            "layer": 2.0,
            "multi_row_layer": 2.0,
            "kv_read": 104 * p.kv_token_s,
            "longest_split": 40 / 32 * p.split_token_s,
        },
        rel=1e-12,
    )
    ahead = decode_terms(p, UNBALANCED, 1, 100, 40, sync=False)
    assert (ahead["host_step"], ahead["host_row"], ahead["host_entry"], ahead["multi_row_layer"]) == (
        0,
        0,
        0,
        0,
    )
    model = TransferredModel(KNOWN, tiny(), "h200", 1, 16, UNBALANCED, max_graph_batch_size=0)
    by_hand = sum(KNOWN.decode[t] * terms[t] for t in DECODE_TERMS) + p.weight_s  # weight-bound GEMMs
    assert model.decode_step_time(4, 100, 40) == pytest.approx(by_hand, rel=1e-12)

    mixed = StepShape("mixed", 3, 1, 202, 200, 900, 600, prefill_attn_work=30_000.0)
    terms = prefill_terms(p, mixed)
    assert terms == pytest.approx(
        {
            "host_step": 1.0,
            "host_seq": 3.0,
            "host_entry": 3 * 600 / 16,
            "layer": 2.0,
            "activation": 202 * p.activation_token_s,
            "attention": 30_000 * p.pair_s,
            "kv_read": (900 + 202) * p.kv_token_s,
        },
        rel=1e-12,
    )
    by_hand = sum(KNOWN.prefill[t] * terms[t] for t in PREFILL_TERMS) + max(
        p.weight_s, 202 * p.token_flops_s + 3 * p.seq_flops_s
    )
    assert model.predict(mixed).total == pytest.approx(by_hand, rel=1e-12)


def test_prefill_floor_is_per_layer():
    floored = TransferCoefficients(
        KNOWN.decode, KNOWN.prefill, {"prefill": 5e-3, "mixed": 4e-3}, PINNED, "H200-SXM"
    )
    step = StepShape("prefill", 1, 1, 16, 16, 0, 16, prefill_attn_work=136.0)
    for layers in (2, 3):
        t = TransferredModel(floored, tiny(layers), "h200", 1, 16, UNBALANCED).predict(step)
        assert t.total == pytest.approx(5e-3 * layers, rel=1e-12)
        assert t.linear + t.attention + t.communication + t.overhead == pytest.approx(t.total, rel=1e-12)


def _records(model: ModelSpec, block_size: int, coefficients: TransferCoefficients, seed: int) -> RecordSet:
    """Decode, prefill and mixed steps of varied shapes timed by `coefficients` exactly (some decode
    steps scheduled ahead)."""
    rng = np.random.default_rng(seed)
    latency = TransferredModel(coefficients, model, "h200", 1, block_size, UNBALANCED, 0)
    ahead = latency.overlapped_model()
    rows = []
    for i in range(300):
        n = int(rng.choice([1, 2, 3, 8, 17, 64, 200]))
        length = int(rng.integers(2, 6000))
        ctx = int(rng.integers(length - 1, max(length, n * length)))
        shape = StepShape.decode(n, ctx, length)
        overlapped = bool(i % 3 == 0)
        wall = (ahead if overlapped else latency).predict(shape).total
        rows.append({**_columns(shape), "wall_time_s": wall, "overlapped": overlapped})
    for _ in range(200):
        seqs = int(rng.integers(1, 40))
        prefills = int(rng.integers(1, min(seqs, 4) + 1))
        kind = "prefill" if prefills == seqs else "mixed"
        new = int(rng.integers(16, 4000))
        tokens = new + (seqs - prefills)
        ctx = int(rng.integers(0, 50_000))
        length = int(rng.integers(new, new + 8000))
        work = float(rng.integers(new, new * new))
        shape = StepShape(kind, seqs, prefills, tokens, new, ctx, length, prefill_attn_work=work)
        rows.append({**_columns(shape), "wall_time_s": latency.predict(shape).total, "overlapped": False})
    frame = pd.DataFrame(rows).assign(compiled=False)
    return RecordSet(f"{model.name}_bs{block_size}", frame, model, block_size, UNBALANCED, 0)


def _columns(shape: StepShape) -> dict:
    return {
        "kind": shape.kind,
        "num_seqs": shape.num_seqs,
        "num_prefill_seqs": shape.num_prefill_seqs,
        "num_decode_seqs": shape.num_decode_seqs,
        "total_num_scheduled_tokens": shape.total_num_scheduled_tokens,
        "num_prefill_tokens": shape.num_prefill_tokens,
        "total_num_cached_tokens": 0,
        "num_context_tokens": shape.num_context_tokens,
        "max_seq_len": shape.max_seq_len,
        "prefill_attn_work": shape.prefill_attn_work,
    }


def test_fit_recovers_known_coefficients_from_records_they_made():
    sets = [_records(tiny(2), 16, KNOWN, 0), _records(tiny(5), 64, KNOWN, 1)]
    fit = fit_transfer(sets, "h200", loss="absolute", pinned=PINNED, floors=False)
    for term in DECODE_TERMS:
        assert fit.decode[term] == pytest.approx(KNOWN.decode[term], rel=1e-6), term
    for term in PREFILL_TERMS:
        assert fit.prefill[term] == pytest.approx(KNOWN.prefill[term], rel=1e-6), term
    errors = fit.extra["fit"]["training_error"]
    assert all(e[kind]["p90"] < 1e-9 for e in errors.values() for kind in ("decode", "prefill"))
    assert [r["file"] for r in fit.extra["fit"]["records"]] == ["tiny-2_bs16", "tiny-5_bs64"]


def test_transfer_to_another_gpu_scales_by_the_spec_sheets():
    """Terms of bytes scale by the datasheet bandwidths, terms of FLOPs by the datasheet peaks, host and
    per-layer terms not at all (the H100 has no measured ceilings: the H200's ratios apply)."""
    spec = tiny(4)
    on = {gpu: TransferredModel(KNOWN, spec, gpu, 1, 16, UNBALANCED, 0) for gpu in ("h200", "h100", "a100")}
    h200, h100, a100 = on["h200"], on["h100"], on["a100"]
    assert h100.pinned == h200.pinned == PINNED
    bw = 4.8e12 / 3.35e12
    lin, att, comm, ovh = h200._decode_parts(8, 5_000, 900)
    lin1, att1, comm1, ovh1 = h100._decode_parts(8, 5_000, 900)
    assert (lin1 / lin, att1 / att, comm1, ovh1) == (pytest.approx(bw), pytest.approx(bw), 0.0, ovh)
    # a prefill step of matrix FLOPs and attention FLOPs only: the peaks' ratio
    flops_only = TransferCoefficients(
        dict.fromkeys(DECODE_TERMS, 0.0),
        {**dict.fromkeys(PREFILL_TERMS, 0.0), "attention": 1.0},
        dict.fromkeys(FLOOR_KINDS, 0.0),
        PINNED,
        "H200-SXM",
    )
    big = StepShape("prefill", 1, 1, 8192, 8192, 0, 8192, prefill_attn_work=8192 * 8193 / 2)
    t200 = TransferredModel(flops_only, spec, "h200", 1, 16, UNBALANCED).predict(big)
    t100 = TransferredModel(flops_only, spec, "a100", 1, 16, UNBALANCED).predict(big)
    assert t100.total / t200.total == pytest.approx(989.4 / 312, rel=1e-12)
    assert a100.decode_step_time(1, 0, 1) > h200.decode_step_time(1, 0, 1)


def test_the_overlapped_view_drops_the_host_terms_only():
    model = TransferredModel(KNOWN, tiny(), "h200", 1, 16, UNBALANCED, 256)
    ahead = model.overlapped_model()
    assert ahead.overlapped and ahead.overlapped_model() is ahead and model.overlapped_model() is ahead
    n, ctx, length = 20, 30_000, 2_000  # padded to 32 rows
    host = (
        KNOWN.decode["host_step"]
        + 32 * KNOWN.decode["host_row"]
        + 32 * length / 16 * KNOWN.decode["host_entry"]
    )
    assert model.decode_step_time(n, ctx, length) - ahead.decode_step_time(n, ctx, length) == pytest.approx(
        host, rel=1e-9
    )
    mixed = StepShape("mixed", 3, 1, 202, 200, 900, 600, prefill_attn_work=30_000.0)
    assert model.predict(mixed) == ahead.predict(mixed)  # prefill and mixed steps are never run ahead


def test_coefficients_file_round_trips_and_is_told_from_a_profile(tmp_path):
    path = KNOWN.save(tmp_path / "t.json")
    assert is_transfer_file(path) and not is_transfer_file(
        SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16.json"
    )
    again = TransferCoefficients.load(path)
    assert (again.decode, again.prefill, again.floors, again.pinned) == (
        KNOWN.decode,
        KNOWN.prefill,
        KNOWN.floors,
        KNOWN.pinned,
    )
    raw = json.loads(path.read_text())
    del raw["decode"]["kv_read"]
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="decode: terms"):
        TransferCoefficients.load(tmp_path / "bad.json")


def test_shipped_coefficients_are_fitted_on_profiling_sweeps_only():
    raw = json.loads(TRANSFER_MODEL.read_text())
    files = [r["file"] for r in raw["fit"]["records"]]
    assert len(files) == 7 and all(f.startswith("steps_") for f in files)
    assert all((SHIPPED_PROFILE_DIR / "records" / f).is_file() for f in files)
    suite = json.loads((SHIPPED_PROFILE_DIR.parent / "data" / "validation" / "suite.json").read_text())
    replays = {r["run"] for r in suite["replays"]}
    assert not replays & set(files)
    loo = raw["leave_one_out"]
    assert [p["pair"] for p in loo["pairs"]] == [
        "Qwen3-0.6B -> Qwen3-8B",
        "block 16 -> block 256",
        "sync -> async",
    ]
    for pair in loo["pairs"]:  # each fitted on one side, scored on the other
        assert not set(pair["fitted_on"]) & set(pair["errors"])
    worst = max(e["decode"]["p90"] for p in loo["pairs"] for e in p["errors"].values())
    assert loo["decode"] == worst


@pytest.fixture
def qwen06() -> ModelSpec:
    from simulator.models import resolve_model

    return resolve_model("qwen3-0.6b")


def test_no_fitted_profile_means_the_transferred_model(qwen06):
    fitted = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16.json"
    assert default_latency_file("qwen3-0.6b", "H200", 16, 1) == fitted
    assert default_latency_file("qwen3-0.6b", "H100", 16, 1) == TRANSFER_MODEL
    assert default_latency_file("qwen3-0.6b", "H200", 64, 1) == TRANSFER_MODEL
    assert profile_for("auto", "qwen3-0.6b", "H100", 16, 1) == TRANSFER_MODEL
    assert profile_for("roofline", "qwen3-0.6b", "H100", 16, 1) is None  # the roofline, by name

    config = SimConfig(model=qwen06, gpu="H100", block_size=64)
    latency = load_latency(config, TRANSFER_MODEL)
    assert isinstance(latency, TransferredModel) and latency.block_size == 64
    assert latency.split_kv == SplitKV(num_kv_heads=8, num_sms=132, block_size=64, balanced=True)
    assert isinstance(load_latency(config, None), RooflineModel)
    with pytest.raises(ValueError, match="block_size"):
        load_latency_model(TRANSFER_MODEL, qwen06, "H100", 1, None)

    summary = run_simulation(traces.generate(num_requests=6, seed=0), config, profile=TRANSFER_MODEL).summary
    assert (summary["latency_model"], summary["profile"]) == ("transferred", "transfer_h200.json")
    assert latency_label(summary["latency_model"], summary["profile"]) == "transferred transfer_h200.json"
    assert summary["steps_outside_fit"] is None  # no fit ranges to count against


def test_its_band_is_its_leave_one_out_error(qwen06):
    loo = json.loads(TRANSFER_MODEL.read_text())["leave_one_out"]
    latency = load_latency(SimConfig(model=qwen06, gpu="H100"), TRANSFER_MODEL)
    errors = band_errors(latency, TRANSFER_MODEL)
    assert (errors.decode, errors.prefill) == (loo["decode"], loo["prefill"])
    assert errors.source == "largest leave-one-out p90 relative step-time error of transfer_h200.json"
    assert profile_band_errors(TRANSFER_MODEL) == errors
    assert 0 < errors.decode < 1 and not math.isnan(errors.prefill)


@pytest.mark.parametrize("block_size", [16, 256])
def test_memoised_splits_are_the_kernels_rule(block_size):
    """The balanced kernel's splits, memoised by (padded batch, split units, target units), equal
    `SplitKV.divisor` (`engine.decode_splits`) step for step, also along decode runs."""
    model = TransferredModel(KNOWN, tiny(), "h200", 1, block_size, max_graph_batch_size=256)
    rng = np.random.default_rng(block_size)
    for _ in range(3000):
        b = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]))
        length = int(rng.integers(1, 40_000))
        ctx = int(rng.integers(length - 1, b * length + 1))
        for step in range(3):  # a run: context + b a step, the longest sequence + 1
            c, m = ctx + step * b, length + step
            assert model._splits(b, c, m) == model.split_kv.divisor(b, c, m), (b, c, m)
