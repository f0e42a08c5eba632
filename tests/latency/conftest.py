"""Shared helpers for the latency-model tests: a tiny model, real decode batches, synthetic records."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from engine.core.scheduler import ScheduledBatch, make_batch
from engine.core.sequence import Sequence
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams

# Known coefficients of the synthetic step-time function (seconds per unit of each feature).
# const, padded batch, context, max_seq_len, b*max, max_seq_len / splits (SPLIT_KV's, of the padded
# batch), padded batch > 1
TRUE_DECODE = (2.0e-3, 2.0e-5, 3.0e-8, 1.0e-7, 2.0e-9, 3.0e-7, 4.0e-4)
SPLIT_KV_FIELDS = {"num_kv_heads": 8, "num_sms": 132}  # Qwen3-0.6B on an H200: 32 splits at batch 1
TRUE_PREFILL = (
    3.0e-3,
    2.5e-6,
    1.0e-10,
    2.0e-8,
    5.0e-5,
    1.0e-5,
)  # const, tokens, attn work, ctx, seqs, decodes
GMAX = 256  # largest decode graph in the synthetic engine run (max_num_seqs = 256)


def qwen3_0_6b() -> ModelSpec:
    return ModelSpec(
        name="Qwen3-0.6B",
        architecture="Qwen3ForCausalLM",
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=1024,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1e6,
    )


def decode_batch(computed: list[int]) -> ScheduledBatch:
    """A real decode-only ScheduledBatch: sequence i has computed[i] tokens cached and one pending."""
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    seqs = [Sequence(i, [7] * (c + 1), params) for i, c in enumerate(computed)]
    for s, c in zip(seqs, computed):
        s.num_computed_tokens = c
    batch = make_batch(seqs, [1] * len(seqs), list(computed), [0] * len(seqs), [], 0)
    assert batch.kind == "decode"
    return batch


def synthetic_records(
    n_decode: int = 400, n_prefill: int = 300, noise: float = 0.01, seed: int = 1
) -> pd.DataFrame:
    """Step records whose gpu_time_s is the known linear function of the features times lognormal noise,
    plus a few compiled steps with absurd times that a fit must drop."""
    from simulator.latency.fitted import SplitKV, graph_padded_batch_size

    split_kv = SplitKV(**SPLIT_KV_FIELDS)

    rng, one_row = np.random.default_rng(seed), np.random.default_rng(seed + 1000)
    rows = []
    for _ in range(n_decode):
        n = int(rng.integers(1, 257))
        ctx = rng.integers(1, int(rng.integers(100, 4000)), size=n)
        ctx[0] = rng.integers(1, 8000)  # the longest context is not tied to the sum
        if one_row.random() < 0.1:  # one-row steps, so that multi_row varies (rng's draws unchanged)
            n, ctx = 1, ctx[:1]
        padded = graph_padded_batch_size(n, GMAX)
        t = (
            TRUE_DECODE[0]
            + TRUE_DECODE[1] * padded
            + TRUE_DECODE[2] * ctx.sum()
            + TRUE_DECODE[3] * (ctx.max() + 1)
            + TRUE_DECODE[4] * padded * (ctx.max() + 1)
            + TRUE_DECODE[5] * (ctx.max() + 1) / split_kv.num_splits(padded)
            + TRUE_DECODE[6] * (padded > 1)
        )
        rows.append(
            dict(kind="decode", num_seqs=n, num_prefill_seqs=0, num_decode_seqs=n, total_num_scheduled_tokens=n,
                 num_prefill_tokens=0, total_num_cached_tokens=0, num_context_tokens=int(ctx.sum()),
                 max_seq_len=int(ctx.max()) + 1, prefill_attn_work=0.0, graph_batch_size=padded, t=t)
        )  # fmt: skip
    for _ in range(n_prefill):
        n_pre = int(rng.integers(1, 31))
        n_dec = int(rng.integers(0, 100)) if rng.random() < 0.5 else 0
        new = rng.integers(1, 2000, size=n_pre)
        cpre = rng.integers(0, 4000, size=n_pre) * (rng.random(n_pre) < 0.3)
        cdec = rng.integers(1, 4000, size=n_dec)
        work = float(np.sum(new * (cpre + (new + 1) / 2)))
        tokens = int(new.sum()) + n_dec
        ctx = int(cpre.sum() + cdec.sum())
        feats = (1, tokens, work, ctx, n_pre + n_dec, n_dec)
        t = sum(c * f for c, f in zip(TRUE_PREFILL, feats))
        max_len = int(max((cpre + new).max(), (cdec + 1).max() if n_dec else 0))
        rows.append(
            dict(kind="mixed" if n_dec else "prefill", num_seqs=n_pre + n_dec, num_prefill_seqs=n_pre,
                 num_decode_seqs=n_dec, total_num_scheduled_tokens=tokens, num_prefill_tokens=int(new.sum()),
                 total_num_cached_tokens=0, num_context_tokens=ctx, max_seq_len=max_len, prefill_attn_work=work,
                 graph_batch_size=0, t=t)
        )  # fmt: skip
    df = pd.DataFrame(rows)
    df["gpu_time_s"] = df.pop("t") * np.exp(rng.normal(0.0, noise, size=len(df)))
    df["wall_time_s"] = df["gpu_time_s"] * 1.1
    df["compiled"] = False
    df.loc[[0, n_decode, n_decode + 1], ["compiled", "gpu_time_s"]] = [True, 3.4]
    df.insert(0, "step", np.arange(len(df)))
    df["num_kv_blocks_used"] = 0
    df["tp"] = 1
    df["block_size"] = 256
    return df


@pytest.fixture(scope="session")
def truth() -> SimpleNamespace:
    """The synthetic records' true coefficients and largest decode graph."""
    from simulator.latency.fitted import SplitKV

    return SimpleNamespace(
        decode=TRUE_DECODE, prefill=TRUE_PREFILL, gmax=GMAX, split_kv=SplitKV(**SPLIT_KV_FIELDS)
    )


@pytest.fixture(scope="session")
def model() -> ModelSpec:
    return qwen3_0_6b()


@pytest.fixture(scope="session")
def records() -> pd.DataFrame:
    return synthetic_records()


@pytest.fixture(scope="session")
def make_records():
    return synthetic_records


@pytest.fixture(scope="session")
def make_decode_batch():
    return decode_batch


@pytest.fixture(scope="session")
def latency_models(model: ModelSpec, records: pd.DataFrame) -> dict:
    """One of each kind of model, TP and CUDA-graph setting."""
    from simulator.latency import (
        FittedModel,
        RooflineEfficiency,
        RooflineModel,
        SplitKV,
        StepFloors,
        fit_step_records,
    )

    split_kv = SplitKV(**SPLIT_KV_FIELDS)
    balanced = SplitKV(**SPLIT_KV_FIELDS, block_size=16, balanced=True)
    fitted = fit_step_records(records, max_num_seqs=GMAX, split_kv=split_kv)
    # host floors that bind: decode steps of small batches and short sequences run at 2.7 ms
    floors = StepFloors(decode=2.7e-3, prefill=4e-3, mixed=3.5e-3)

    return {
        "roofline-h200": RooflineModel(model, "h200"),
        "roofline-h100-tp2": RooflineModel(model, "h100", tp=2),
        "roofline-l40s-tp4": RooflineModel(
            model, "l40s", tp=4, efficiency=RooflineEfficiency(gemm_flops=0.55)
        ),
        "fitted": fitted,
        "fitted-floored": FittedModel(fitted.decode, fitted.prefill, GMAX, split_kv=split_kv, floors=floors),
        "fitted-eager": fit_step_records(records.assign(graph_batch_size=0), split_kv=split_kv),
        "fitted-no-split": fit_step_records(records, max_num_seqs=GMAX),
        # balanced splits (the engine's default): the longest split changes within a run
        "fitted-balanced": FittedModel(
            _with_longest_split(fitted.decode), fitted.prefill, GMAX, split_kv=balanced
        ),
        "fitted-balanced-floored": FittedModel(
            _with_longest_split(fitted.decode), fitted.prefill, GMAX, split_kv=balanced, floors=floors
        ),
        # the table term of steps not scheduled ahead (block 16: it changes every 16 steps of a run)
        "fitted-table": FittedModel(
            _with_table(fitted.decode), fitted.prefill, GMAX, split_kv=split_kv, block_size=16
        ),
        "fitted-table-balanced-floored": FittedModel(
            _with_table(_with_longest_split(fitted.decode)),
            fitted.prefill,
            GMAX,
            split_kv=balanced,
            floors=floors,
            block_size=16,
        ),
        **_transferred_models(model),
    }


def _with_table(decode):
    """`decode` with the sync terms 0.3 ms + 5 us a padded row and 50 ns a block-table entry."""
    from simulator.latency import LinearFit
    from simulator.latency.fitted import TABLE_DECODE_FEATURES

    return LinearFit(TABLE_DECODE_FEATURES, (*decode.coefficients[:7], 3e-4, 5e-6, 5e-8))


def _transferred_models(model: ModelSpec) -> dict:
    """The shipped transferred model: today's engine's kernel (balanced splits) on the H200, the
    overlapped view of it, and the unbalanced kernel at TP 2 on an H100."""
    from simulator.defaults import TRANSFER_MODEL
    from simulator.latency import SplitKV
    from simulator.latency.transfer import TransferCoefficients, TransferredModel

    c = TransferCoefficients.load(TRANSFER_MODEL)
    balanced = TransferredModel(c, model, "h200", block_size=16)
    unbalanced_kernel = SplitKV(num_kv_heads=model.num_kv_heads // 2, num_sms=132)
    unbalanced = TransferredModel(c, model, "h100", tp=2, block_size=256, split_kv=unbalanced_kernel)
    return {
        "transferred": balanced,
        "transferred-overlapped": balanced.overlapped_model(),
        "transferred-h100-tp2": unbalanced,
    }


def _with_longest_split(decode):
    """`decode` with a longest_split coefficient of at least 2e-7 s a token (so that it shows)."""
    from simulator.latency import LinearFit

    coefs = list(decode.coefficients)
    coefs[5] = max(coefs[5], 2e-7)
    return LinearFit(decode.features, tuple(coefs))
