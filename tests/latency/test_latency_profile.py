"""LatencyProfile: JSON round trip, compatibility errors, and the load_latency_model factory."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from engine.model_spec import ModelSpec
from simulator.latency import (
    FittedModel,
    LatencyProfile,
    RooflineEfficiency,
    RooflineModel,
    SplitKV,
    StepShape,
    fit_profile,
    load_latency_model,
)

LLAMA_3_8B = ModelSpec("Llama-3-8B", "LlamaForCausalLM", 32, 32, 8, 128, 4096, 14336, 128256)


@pytest.fixture(scope="module")
def profile(records: pd.DataFrame, model: ModelSpec, truth) -> LatencyProfile:
    return fit_profile(
        records,
        model=model,
        gpu="h200",
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        attention_backend="flash_attn.cute",
        engine_version="0.1.0",
        num_kv_blocks=4516,
        created="2026-11-29T08:00:00+00:00",
        split_kv=truth.split_kv,
    )


def test_metadata(profile: LatencyProfile, model: ModelSpec) -> None:
    assert profile.describe() == "Qwen3-0.6B on H200-SXM tp=1 block 256"
    assert profile.model_spec() == model
    assert (profile.tp, profile.block_size, profile.dtype) == (1, 256, "bfloat16")  # tp, block from records
    assert (profile.num_kv_blocks, profile.max_graph_batch_size, profile.num_records) == (4516, 256, 697)
    assert profile.target == "gpu_time_s"
    assert profile.extra == {
        "seed": 0,
        "holdout_fraction": 0.25,
        "loss": "absolute",
        "fit_ranges": {  # the largest figures of the records, per step kind (simulator/latency/ranges.py)
            "decode": {
                "num_seqs": 256,
                "num_context_tokens": 494265,
                "max_seq_len": 7998,
                "total_num_scheduled_tokens": 256,
            },
            "prefill": {
                "num_seqs": 128,
                "num_context_tokens": 215393,
                "max_seq_len": 5882,
                "total_num_scheduled_tokens": 34944,
            },
            "source": "",
        },
    }
    assert profile.decode.error is not None and profile.decode.error.median_rel_error < 0.012
    assert (profile.split_kv.num_kv_heads, profile.split_kv.num_sms) == (8, 132)
    assert profile.to_latency_model().split_kv == profile.split_kv


def test_round_trip_is_exact(profile: LatencyProfile, tmp_path) -> None:
    path = profile.save(tmp_path / "p.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "kvplan.latency_profile" and raw["version"] == 1
    assert raw["model"]["name"] == "Qwen3-0.6B" and raw["prefill"]["fit_error"]["n_test"] > 0
    assert raw["split_kv"] == {"num_kv_heads": 8, "num_sms": 132}
    assert set(raw["floors"]) == {"decode", "prefill", "mixed"} and profile.floors is not None
    loaded = LatencyProfile.load(path)
    assert loaded == profile
    a, b = profile.to_latency_model(), loaded.to_latency_model()
    assert b.profile is loaded
    for n, ctx, max_len in [(1, 0, 1), (17, 9000, 1200), (300, 500_000, 4000)]:
        assert a.decode_step_time(n, ctx, max_len).hex() == b.decode_step_time(n, ctx, max_len).hex()
    shape = StepShape("mixed", 10, 2, 2008, 2000, 50_000, 4000, 1.5e6)
    assert a.predict(shape) == b.predict(shape)
    balanced = dataclasses.replace(profile, split_kv=SplitKV(8, 132, 16, balanced=True))
    raw = json.loads(balanced.save(tmp_path / "b.json").read_text())
    assert raw["split_kv"] == {"num_kv_heads": 8, "num_sms": 132, "block_size": 16, "balanced": True}
    assert LatencyProfile.load(tmp_path / "b.json") == balanced
    fine = dataclasses.replace(profile, split_kv=SplitKV(8, 132, 256, balanced=True, split_tokens=64))
    raw = json.loads(fine.save(tmp_path / "f.json").read_text())
    assert raw["split_kv"] == {
        "num_kv_heads": 8,
        "num_sms": 132,
        "block_size": 256,
        "balanced": True,
        "split_tokens": 64,
    }
    assert LatencyProfile.load(tmp_path / "f.json") == fine


def test_mismatch_lists_every_difference(profile: LatencyProfile) -> None:
    with pytest.raises(ValueError) as info:
        profile.check_compatible(model=LLAMA_3_8B, gpu="H100", tp=2, block_size=16)
    msg = str(info.value)
    assert msg.startswith(
        "profile is for Qwen3-0.6B on H200-SXM tp=1 block 256; asked for Llama-3-8B on H100-SXM tp=2 block 16: "
    )
    for part in ("model Qwen3-0.6B != Llama-3-8B (", "num_layers 28 != 32", "hidden_size 1024 != 4096",
                 "gpu H200-SXM != H100-SXM", "tp 1 != 2", "block_size 256 != 16"):  # fmt: skip
        assert part in msg, part


def test_compatible_configurations_pass(profile: LatencyProfile, model: ModelSpec) -> None:
    profile.check_compatible(model=model, gpu="NVIDIA H200", tp=1, block_size=256, dtype="bfloat16")
    profile.check_compatible(
        model=dataclasses.replace(model, name="qwen3-0.6b-random-weights")
    )  # same shapes
    profile.check_compatible(model="qwen3-0.6b")
    profile.check_compatible()
    with pytest.raises(ValueError, match=r"asked for block 16: mismatched block_size 256 != 16$"):
        profile.check_compatible(block_size=16)
    with pytest.raises(ValueError, match=r"mismatched model Qwen3-0.6B \(dtype bfloat16 != float16\)$"):
        profile.check_compatible(model=dataclasses.replace(model, dtype="float16"))


def test_load_latency_model_picks_profile_or_roofline(
    profile: LatencyProfile, model: ModelSpec, tmp_path
) -> None:
    path = profile.save(tmp_path / "qwen3_h200.json")
    fitted = load_latency_model(path, model, "h200", 1, 256)
    assert isinstance(fitted, FittedModel) and fitted.profile == profile
    roof = load_latency_model(None, model, "h100", tp=2, efficiency=RooflineEfficiency(gemm_flops=0.6))
    assert isinstance(roof, RooflineModel) and roof.tp == 2 and roof.gpu.name == "H100-SXM"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: profile is for .* tp 1 != 2"):
        load_latency_model(path, model, "h200", tp=2)
    with pytest.raises(ValueError, match="efficiency: applies to the roofline model only"):
        load_latency_model(path, model, "h200", efficiency=RooflineEfficiency())


def test_bad_files_name_the_file(profile: LatencyProfile, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no latency profile here"):
        LatencyProfile.load(tmp_path / "missing.json")
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not valid JSON"):
        LatencyProfile.load(path)
    raw = profile.to_dict()
    for change, message in [
        ({"version": 2}, "profile version 2 is not supported"),
        ({"format": "other"}, "not a latency profile"),
        ({"decode": {"features": ["const"], "coefficients": [1.0]}}, "decode fit features"),
        ({"prefill": {"features": ["const"]}}, "field 'prefill' is malformed"),
        ({"split_kv": {"num_kv_heads": 8}}, "field 'split_kv' must be null, {num_kv_heads, num_sms} or"),
        ({"split_kv": {"num_kv_heads": 8, "num_sms": -1}}, "split_kv.num_sms: must be a positive integer"),
        (
            {
                "split_kv": {
                    "num_kv_heads": 8,
                    "num_sms": 132,
                    "block_size": 256,
                    "balanced": True,
                    "split_tokens": -64,
                }
            },
            "split_kv.split_tokens: must be a non-negative integer, got -64",
        ),
        ({"floors": {"decode": 1e-3, "warmup": 1.0}}, "field 'floors' must be null or seconds by step kind"),
        ({"floors": {"mixed": -1.0}}, "floors.mixed: must be a finite time >= 0 s"),
    ]:
        path.write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: .*{message}"):
            LatencyProfile.load(path)
    del raw["split_kv"]  # profiles from before split_kv load without one
    path.write_text(json.dumps(raw))
    assert LatencyProfile.load(path).split_kv is None
    del raw["floors"]  # nor floors: such a profile predicts with its linear fits alone
    path.write_text(json.dumps(raw))
    unfloored = LatencyProfile.load(path)
    assert unfloored.floors is None and unfloored.to_latency_model().floors is None
    del raw["tp"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: missing field 'tp'"):
        LatencyProfile.load(path)


def test_the_fits_own_settings_win_over_copied_provenance(records: pd.DataFrame, model: ModelSpec) -> None:
    """`kvplan fit --like P` copies P's extra; the loss and seed recorded are the refit's."""
    refit = fit_profile(records, model=model, gpu="h200", max_num_seqs=256, max_num_batched_tokens=16384,
                        loss="median", seed=3, extra={"loss": "absolute", "seed": 0, "note": "kept"})  # fmt: skip
    assert (refit.extra["loss"], refit.extra["seed"], refit.extra["note"]) == ("median", 3, "kept")


def test_profile_metadata_must_agree_with_records(records: pd.DataFrame, model: ModelSpec) -> None:
    with pytest.raises(ValueError, match="block_size: given 16 but the step records say 256"):
        fit_profile(
            records, model=model, gpu="h200", max_num_seqs=256, max_num_batched_tokens=16384, block_size=16
        )
    with pytest.raises(ValueError, match="tp and block_size: not in the step records"):
        fit_profile(
            records.drop(columns=["tp"]),
            model=model,
            gpu="h200",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
        )


def _same_fit(refit, original) -> bool:
    """Coefficients of a refit equal the shipped ones to 1e-9: least squares on the same records
    agrees to the last bits only on the same numpy and BLAS build."""
    return list(refit) == pytest.approx(list(original), rel=1e-9, abs=1e-15)


def _same_floors(refit, original) -> bool:
    """Host floors of a refit equal the shipped ones to 1e-9 (see `_same_fit`)."""
    return _same_fit(dataclasses.astuple(refit), dataclasses.astuple(original))


def test_kvplan_fit_refits_a_shipped_profile(tmp_path, capsys) -> None:
    """`kvplan fit` on a shipped profile's own records, with its split policy and the median loss,
    gives that profile's coefficients and host floors back (--no-floors: the same coefficients, no
    floors); a malformed --split-kv names the flag."""
    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR

    shipped = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs256.json"
    records = SHIPPED_PROFILE_DIR / "records" / "steps_qwen3-0.6b_h200_tp1_bs256.parquet"
    out = tmp_path / "refit.json"
    assert main(["fit", "--records", str(records), "--like", str(shipped), "--out", str(out)]) == 0
    refit, original = LatencyProfile.load(out), LatencyProfile.load(shipped)
    assert refit.split_kv == original.split_kv and refit.extra["loss"] == "median"
    assert _same_fit(refit.decode.coefficients, original.decode.coefficients)
    assert _same_fit(refit.prefill.coefficients, original.prefill.coefficients)
    assert _same_floors(refit.floors, original.floors) and original.floors.decode > 0.0
    assert (
        main(["fit", "--records", str(records), "--like", str(shipped), "--out", str(out), "--no-floors"])
        == 0
    )
    unfloored = LatencyProfile.load(out)
    assert unfloored.floors is None and _same_fit(
        unfloored.prefill.coefficients, original.prefill.coefficients
    )
    argv = [
        "fit",
        "--records",
        str(records),
        "--like",
        str(shipped),
        "--out",
        str(out),
        "--split-kv",
        "8x132",
    ]
    assert main(argv) == 2
    assert "--split-kv: '8x132': expected KV_HEADS:SMS" in capsys.readouterr().err


def test_the_async_profile_refits_with_its_sync_terms(tmp_path) -> None:
    """The shipped block-16 `_async` profile (records of an engine scheduling asynchronously, with
    `overlapped` steps) refits from its records (to 1e-9: `_same_fit`), sync and block-table terms
    included, and loads into a model whose overlapped view drops them; it was fitted without the
    prefix-hit term, which a flag adds (beside its span term); `default_profile` picks it for async
    scheduling where it exists."""
    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR, default_profile
    from simulator.latency.fitted import ASYNC_DECODE_FEATURES, PREFIX_FEATURES, TABLE_FEATURES

    shipped = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16_async.json"
    records = SHIPPED_PROFILE_DIR / "records" / "steps_qwen3-0.6b_h200_tp1_bs16_async.parquet"
    out = tmp_path / "refit.json"
    assert main(["fit", "--records", str(records), "--like", str(shipped), "--out", str(out)]) == 0
    refit, original = LatencyProfile.load(out), LatencyProfile.load(shipped)
    assert refit.decode.features == ASYNC_DECODE_FEATURES + TABLE_FEATURES
    assert _same_fit(refit.decode.coefficients, original.decode.coefficients)
    assert _same_floors(refit.floors, original.floors)
    # the prefix-hit term follows --like's profile unless a flag says otherwise
    assert PREFIX_FEATURES[0] not in refit.prefill.features
    assert _same_fit(refit.prefill.coefficients, original.prefill.coefficients)
    with_term = tmp_path / "with_term.json"
    assert main(["fit", "--records", str(records), "--like", str(shipped), "--prefix-hit-term",
                 "--out", str(with_term)]) == 0  # fmt: skip
    assert PREFIX_FEATURES[0] in LatencyProfile.load(with_term).prefill.features
    plain = tmp_path / "plain.json"
    assert main(["fit", "--records", str(records), "--like", str(shipped), "--prefix-hit-term",
                 "--no-prefix-hit-term", "--out", str(plain)]) == 2  # fmt: skip
    model = original.to_latency_model()
    (sync, sync_per_row), per_entry = model.sync_coefficients, model.table_coefficient
    # 0.56 ms + 3.8 us a padded row + 1.4 ns a block-table entry (the engine with kept table rows and
    # their device copy: 8.3 ns an entry without the copy)
    assert 5.5e-4 < sync < 5.7e-4 and 3.8e-6 < sync_per_row < 3.9e-6 and 1.4e-9 < per_entry < 1.5e-9
    gap = model.decode_step_time(100, 120_000, 4000) - model.overlapped_model().decode_step_time(
        100, 120_000, 4000
    )
    assert gap == pytest.approx(sync + sync_per_row * 112 + per_entry * 100 * 250, rel=1e-9)
    assert default_profile("qwen3-0.6b", "H200", 16, 1, async_scheduling=True) == shipped
    assert (
        default_profile("qwen3-0.6b", "H200", 16, 1) == SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16.json"
    )
    picked = default_profile("qwen3-8b", "H200", 256, 1, async_scheduling=True)
    assert picked == SHIPPED_PROFILE_DIR / "qwen3-8b_h200_tp1_bs256_async.json"


def test_async_scheduling_falls_back_to_the_sync_profile(tmp_path, monkeypatch) -> None:
    """Where no `_async` profile ships for a configuration, async scheduling gets the synchronous
    engine's profile; with neither, none."""
    import simulator.defaults as defaults

    (tmp_path / "qwen3-8b_h200_tp1_bs256.json").write_text("{}")
    monkeypatch.setattr(defaults, "SHIPPED_PROFILE_DIR", tmp_path)
    picked = defaults.default_profile("qwen3-8b", "H200", 256, 1, async_scheduling=True)
    assert picked == tmp_path / "qwen3-8b_h200_tp1_bs256.json"
    assert defaults.default_profile("qwen3-8b", "H200", 16, 1, async_scheduling=True) is None


@pytest.mark.parametrize(
    ("stem", "table", "sync_range"),
    [
        ("qwen3-0.6b_h200_tp1_bs256", True, (3.5e-4, 3.7e-4, 2.5e-6, 2.7e-6)),  # 0.36 ms + 2.6 us a row
        ("qwen3-8b_h200_tp1_bs16", True, (3.3e-4, 3.5e-4, 6.1e-6, 6.4e-6)),  # 0.34 ms + 6.2 us
        ("qwen3-8b_h200_tp1_bs256", True, (3.5e-4, 3.7e-4, 1.1e-5, 1.2e-5)),  # 0.36 ms + 11.3 us
    ],
)
def test_the_block_256_and_8b_async_profiles_refit_and_are_picked(tmp_path, stem, table, sync_range) -> None:
    """Qwen3-0.6B block 256 and Qwen3-8B blocks 16 and 256 (calibrated with async scheduling on the
    engine with whole-step graphs, block-table term included): each refits from its shipped records (to
    1e-9: `_same_fit`), sync terms included, and is the one `default_profile` picks for async
    scheduling."""
    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR, default_profile
    from simulator.latency.fitted import ASYNC_DECODE_FEATURES, TABLE_FEATURES

    shipped = SHIPPED_PROFILE_DIR / f"{stem}_async.json"
    records = SHIPPED_PROFILE_DIR / "records" / f"steps_{stem}_async.parquet"
    out = tmp_path / "refit.json"
    args = ["fit", "--records", str(records), "--like", str(shipped), "--out", str(out)]
    assert main(args if table else [*args, "--no-host-table"]) == 0
    refit, original = LatencyProfile.load(out), LatencyProfile.load(shipped)
    assert refit.decode.features == ASYNC_DECODE_FEATURES + (TABLE_FEATURES if table else ())
    assert _same_fit(refit.decode.coefficients, original.decode.coefficients)
    assert _same_floors(refit.floors, original.floors)
    model, block = stem.split("_h200_tp1_bs")
    assert default_profile(model, "H200", int(block), 1, async_scheduling=True) == shipped
    sync, sync_per_row = original.to_latency_model().sync_coefficients
    lo, hi, row_lo, row_hi = sync_range
    assert lo < sync < hi and row_lo < sync_per_row < row_hi


def test_kvplan_fit_can_infer_overlapped_steps_of_older_async_records(tmp_path, capsys) -> None:
    """Async records from before the `overlapped` column: `--infer-overlapped` marks a decode step
    right after a decode step of as many requests. On the first 4,000 steps of the block-16 async
    sweep of 2026-11-30 (tests/data/steps_async_sweep_sample.parquet: a sweep without sync twins) it
    misses 2 of 2,788 overlapped steps and marks none wrongly; the sync terms fitted on the inferred
    column land within 3 % of those fitted on the recorded one. (The sweeps with sync twins, whose
    requests stop at EOS, hold steps this rule cannot tell apart: it is for the older sweeps.)"""
    import pandas as pd

    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR
    from simulator.latency.fitted import infer_overlapped

    like = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16_async.json"
    sample = Path(__file__).parents[1] / "data" / "steps_async_sweep_sample.parquet"
    records = pd.read_parquet(sample)
    inferred, recorded = infer_overlapped(records), records["overlapped"].to_numpy()
    assert (int(recorded.sum()), int((inferred & ~recorded).sum()), int((recorded & ~inferred).sum())) == (
        2788,
        0,
        2,
    )
    assert (
        main(["fit", "--records", str(sample), "--like", str(like), "--out", str(tmp_path / "rec.json")]) == 0
    )
    older = tmp_path / "older.parquet"
    records.drop(columns="overlapped").to_parquet(older, index=False)
    out = tmp_path / "inferred.json"
    argv = ["fit", "--records", str(older), "--like", str(like), "--infer-overlapped", "--out", str(out)]
    assert main(argv) == 0
    refit, fitted = LatencyProfile.load(out), LatencyProfile.load(tmp_path / "rec.json")
    assert refit.extra["overlapped"].startswith("inferred")
    for got, want in zip(refit.decode.coefficients[7:], fitted.decode.coefficients[7:], strict=True):
        assert got == pytest.approx(want, rel=0.03)
    argv[2] = str(sample)
    assert main(argv) == 2
    assert "--infer-overlapped: " in capsys.readouterr().err


def test_parse_split_kv_forms() -> None:
    from simulator.cli import parse_split_kv

    assert parse_split_kv("none") is None
    assert parse_split_kv("8:132") == SplitKV(8, 132)
    assert parse_split_kv("8:132:16") == SplitKV(8, 132, 16, balanced=True)
    assert parse_split_kv("8:132:256:64") == SplitKV(8, 132, 256, balanced=True, split_tokens=64)
    with pytest.raises(ValueError, match=r"--split-kv: '8:132:256:64:1': expected KV_HEADS:SMS"):
        parse_split_kv("8:132:256:64:1")
    with pytest.raises(ValueError, match=r"split_kv.split_tokens: must be a non-negative integer, got -1"):
        parse_split_kv("8:132:256:-1")


@pytest.mark.parametrize(
    "stem, expected",
    [
        (
            "qwen3-0.6b_h200_tp1_bs16_async_2026-12-02",
            (0.0011207381980545088, 0.02367734351165822, 0.03011405001545151, 5.229427305949624),
        ),
        (
            "qwen3-8b_h200_tp1_bs16_async_2026-11-30",
            (0.0051266073565316836, 0.032805119914945474, 0.040058893354079854, 7.508747964776984),
        ),
    ],
)
def test_async_profiles_without_the_table_term_predict_as_before_it(stem, expected) -> None:
    """A profile fitted before TABLE_FEATURES (no coefficient for it; the two shipped until the
    recalibration of 2026-12-02) predicts the floats it predicted then: steps not scheduled ahead (three steps, a 300-step run's end) and, unchanged,
    mixed steps (the prefill fit has no table term)."""
    from simulator.defaults import SHIPPED_PROFILE_DIR
    from simulator.latency.base import StepShape

    model = LatencyProfile.load(SHIPPED_PROFILE_DIR / "superseded" / f"{stem}.json").to_latency_model()
    assert model.table_coefficient == 0.0 and len(model.decode.features) == 9
    shapes = ((1, 100, 101), (64, 700_000, 32_000), (128, 1_000_000, 24_000))
    got = [model.decode_step_time(*s) for s in shapes]
    got.append(model.decode_step_times(64, 500_000, 20_000, 300, 0.0, 1e9)[-1])
    assert tuple(got) == expected
    mixed = {
        "qwen3-0.6b_h200_tp1_bs16_async_2026-12-02": 0.022204064086601208,
        "qwen3-8b_h200_tp1_bs16_async_2026-11-30": 0.06547575267047855,
    }
    assert model.predict(StepShape("mixed", 40, 2, 2048, 2010, 300_000, 32_000, 4e6)).total == mixed[stem]
