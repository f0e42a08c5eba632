"""A latency model that transfers to what was never profiled: roofline terms times fitted efficiencies,
plus host costs, with the coefficients fitted on one GPU's step records and carried to other GPUs
through their spec sheets (data/gpus.json), to other models through their shapes and to other block
sizes through the decode kernel's split rule. Fitting, pricing and the coefficients file are here;
which configuration uses it is `simulator.defaults`'s business.

A step's time is the sum of terms whose physical quantity comes from the step's shape (the roofline's
weight, KV and FLOP counts, `RooflineModel`) and whose coefficient is fitted (non-negative):

decode (padded batch b, context tokens C, longest sequence L, block size B):
  host (paid by a step not scheduled ahead; async scheduling hides it): h0 + h1 b + h2 b L / B
      (per step, per row, per block-table entry: the table is b rows of the longest sequence's pages)
  per layer: num_layers x (k + k_multi [b > 1])      (kernel launches and tails inside the graph)
  matrices: max(weight bytes / (bw e_w), matrix FLOPs / (peak e_f))   (pinned, below)
  KV: (C + b) x KV bytes per token / bw x u_kv        (every row reads its keys once)
  longest split: num_layers x (L / splits) x KV bytes of one head's token x SMs / bw x u_split
      (the step waits for the split-KV kernel's longest program, which streams its share of the
      longest sequence at about one SM's share of the bandwidth; `engine.decode_splits`' rule, so
      block size and batch enter through it)
  TP: 2 layers all-reduces of b x hidden bytes per step (ring, link bandwidth; not fitted)
prefill and mixed (T new tokens, S sequences, P query-key pairs, L longest sequence):
  host: p0 + p1 S + p2 S L / B; per layer: num_layers x k_p
  matrices: max(weight bytes / (bw e_w), (body FLOPs x T + LM-head FLOPs x S) / (peak e_f))
  activations: num_layers x T x hidden x dtype bytes / bw x u_act  (norms, rotary, SiLU, copies)
  attention: P x attention FLOPs per pair / peak x u_attn; KV: (C + T) x KV bytes / bw x u_kvp
  host floor: max(that, num_layers x f_kind), f per kind (prefill, mixed): piecewise graphs launch
      per layer
e_w and e_f are pinned to the reference GPU's measured ceilings over its datasheet (device copy and
large GEMM, gpus.json `measured`): a training set of one model cannot tell a matrix efficiency from a
per-token activation cost, nor a weight-streaming efficiency from a per-step constant. On a GPU
without measured ceilings the reference's ratios apply. Host and per-layer terms are seconds of the
reference machine's host and launch latencies; they do not scale with the spec sheet.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.decode_splits import balance_programs, grid_splits, split_block, split_unit, target_split_units
from engine.model_spec import ModelSpec, dtype_bytes
from simulator.latency.base import (
    BatchShape,
    LatencyModelBase,
    StepTime,
    arange_int64,
)
from simulator.latency.fitted import (
    LOSSES,
    SplitKV,
    _least_absolute_nnls,
    _weighted_nnls,
    fit_floor,
    graph_padded_batch_size,
    max_graph_batch_size,
    split_run,
    split_run_consts,
)
from simulator.latency.gpus import GpuSpec, canonical_gpu_name, get_gpu
from simulator.latency.roofline import RooflineEfficiency, RooflineModel

TRANSFER_FORMAT = "kvplan.transfer_model"
TRANSFER_VERSION = 1
DECODE_TERMS = ("host_step", "host_row", "host_entry", "layer", "multi_row_layer", "kv_read", "longest_split")
PREFILL_TERMS = ("host_step", "host_seq", "host_entry", "layer", "activation", "attention", "kv_read")
HOST_TERMS = ("host_step", "host_row", "host_entry")  # decode terms a step scheduled ahead does not pay
FLOOR_KINDS = ("prefill", "mixed")
DEFAULT_NUM_SMS = 132  # SMs the split rule assumes where the kernel's own count is not given (H200)
DEFAULT_MAX_NUM_SEQS = 256  # the engine's default: decode graphs up to 256 rows


# ---- the decode kernel's split rule -------------------------------------------------------------
def engine_split_kv(
    model: ModelSpec, block_size: int, tp: int = 1, num_sms: int = DEFAULT_NUM_SMS
) -> SplitKV:
    """The split rule of today's engine's default decode kernel for a configuration, as the engine
    records it (`LLM.decode_split_kv`): the Triton split-KV kernel with balanced splits, pages over
    64 tokens split inside."""
    fine = split_block(block_size)
    return SplitKV(
        num_kv_heads=model.num_kv_heads // tp,
        num_sms=num_sms,
        block_size=block_size,
        balanced=True,
        split_tokens=split_unit(fine) if fine != block_size else 0,
    )


# ---- coefficients -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pinned:
    """Efficiencies the fit does not choose: fractions of the datasheet peak that weight streaming
    and large matrix products reach on the reference GPU (its measured ceilings)."""

    weight_bandwidth: float
    matrix_flops: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("weight_bandwidth", "matrix_flops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"Pinned.{name}: must be in (0, 1], got {value!r}")

    @classmethod
    def of_gpu(cls, gpu: GpuSpec | str) -> Pinned:
        """The measured/datasheet ratios of `gpu`; ValueError for a GPU without measured ceilings."""
        spec = get_gpu(gpu)
        m = spec.measured
        if m is None or not m.memory_bandwidth_Bps or not m.bf16_flops:
            raise ValueError(f"{spec.name}: gpus.json has no measured bandwidth and FLOP/s ceilings")
        return cls(
            m.memory_bandwidth_Bps / spec.memory_bandwidth_Bps,
            m.bf16_flops / spec.bf16_flops,
            f"measured / datasheet of {spec.name} (gpus.json, {m.date})",
        )


@dataclass(frozen=True)
class TransferCoefficients:
    """A fit of the transferred model: one coefficient per term (DECODE_TERMS, PREFILL_TERMS), the
    per-layer host floors, the pinned efficiencies and the reference GPU they were fitted on."""

    decode: dict[str, float]
    prefill: dict[str, float]
    floors: dict[str, float]  # seconds per layer, by kind (FLOOR_KINDS)
    pinned: Pinned
    reference_gpu: str
    extra: dict[str, Any] = field(default_factory=dict)  # provenance: records, loss, errors

    def __post_init__(self) -> None:
        for name, terms in (("decode", DECODE_TERMS), ("prefill", PREFILL_TERMS), ("floors", FLOOR_KINDS)):
            got = getattr(self, name)
            if set(got) != set(terms):
                raise ValueError(f"TransferCoefficients.{name}: terms {sorted(got)} != {sorted(terms)}")
            for term, value in got.items():
                if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"TransferCoefficients.{name}[{term!r}]: must be finite and >= 0, got {value!r}"
                    )

    @property
    def leave_one_out(self) -> dict[str, Any] | None:
        """The leave-one-out errors recorded with the fit (`leave_one_out_errors`), if any."""
        return self.extra.get("leave_one_out")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TRANSFER_FORMAT,
            "version": TRANSFER_VERSION,
            "reference_gpu": self.reference_gpu,
            "pinned": {
                "weight_bandwidth": self.pinned.weight_bandwidth,
                "matrix_flops": self.pinned.matrix_flops,
                "source": self.pinned.source,
            },
            "decode": {t: self.decode[t] for t in DECODE_TERMS},
            "prefill": {t: self.prefill[t] for t in PREFILL_TERMS},
            "floors_per_layer": {k: self.floors[k] for k in FLOOR_KINDS},
            **self.extra,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "transfer model") -> TransferCoefficients:
        if raw.get("format") != TRANSFER_FORMAT:
            raise ValueError(
                f"{where}: not a transferred model (format {raw.get('format')!r}, expected {TRANSFER_FORMAT!r})"
            )
        if raw.get("version") != TRANSFER_VERSION:
            raise ValueError(
                f"{where}: version {raw.get('version')!r} is not supported (expected {TRANSFER_VERSION})"
            )
        known = {"format", "version", "reference_gpu", "pinned", "decode", "prefill", "floors_per_layer"}
        try:
            pinned = raw["pinned"]
            return cls(
                decode={k: float(v) for k, v in raw["decode"].items()},
                prefill={k: float(v) for k, v in raw["prefill"].items()},
                floors={k: float(v) for k, v in raw["floors_per_layer"].items()},
                pinned=Pinned(
                    float(pinned["weight_bandwidth"]),
                    float(pinned["matrix_flops"]),
                    str(pinned.get("source", "")),
                ),
                reference_gpu=str(raw["reference_gpu"]),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: malformed transferred model ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> TransferCoefficients:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a transferred model ({e})") from None
        return cls.from_dict(raw, where=str(path))


def is_transfer_file(path: str | Path | None) -> bool:
    """Whether `path` is a transferred model's coefficients file (format kvplan.transfer_model)."""
    if path is None:
        return False
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("format") == TRANSFER_FORMAT


# ---- one configuration's physical quantities --------------------------------------------------
@dataclass(frozen=True)
class StepPhysics:
    """What the terms multiply for one configuration (model, GPU, TP, block size, decode kernel):
    the roofline's counts per rank (`RooflineModel`) over the GPU's datasheet rates."""

    num_layers: int
    block_size: int
    weight_s: float  # weight bytes / (bw e_w): streaming the weights once, at the pinned efficiency
    token_flops_s: float  # body matrix FLOPs of one token / (peak e_f)
    seq_flops_s: float  # LM-head FLOPs of one sequence / (peak e_f)
    kv_token_s: float  # KV bytes of one token (all layers) / bw
    split_token_s: float  # num_layers x KV bytes of one head's token x SMs / bw
    activation_token_s: float  # num_layers x hidden x dtype bytes / bw
    pair_s: float  # attention FLOPs of one query-key pair / peak
    comm_fixed_s: float  # TP all-reduce latencies of one step
    comm_token_s: float  # TP all-reduce bytes of one token / link

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        gpu: GpuSpec | str,
        tp: int,
        block_size: int,
        pinned: Pinned,
        num_sms: int,
        link: RooflineEfficiency | None = None,
    ) -> StepPhysics:
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
        eff = link or RooflineEfficiency()
        rl = RooflineModel(model, gpu, tp=tp, efficiency=eff)
        g = rl.gpu
        bw, peak = g.memory_bandwidth_Bps, g.bf16_flops
        ring = 2 * (tp - 1) / tp  # ring all-reduce: bytes sent per byte reduced (0 at tp = 1)
        link_bw = g.link_bandwidth_Bps * eff.link_bandwidth
        head_token_bytes = rl.kv_bytes_per_token / (model.num_layers * (model.num_kv_heads // tp))
        return cls(
            num_layers=model.num_layers,
            block_size=block_size,
            weight_s=rl.weight_bytes / (bw * pinned.weight_bandwidth),
            token_flops_s=rl.linear_flops_per_token / (peak * pinned.matrix_flops),
            seq_flops_s=rl.lm_head_flops_per_seq / (peak * pinned.matrix_flops),
            kv_token_s=rl.kv_bytes_per_token / bw,
            split_token_s=model.num_layers * head_token_bytes * num_sms / bw,
            activation_token_s=model.num_layers * model.hidden_size * dtype_bytes(model.dtype) / bw,
            pair_s=rl.attention_flops_per_pair / peak,
            comm_fixed_s=rl.allreduce_calls * eff.allreduce_latency_s,
            comm_token_s=rl.allreduce_calls * ring * rl.allreduce_bytes_per_token / link_bw,
        )

    def matrices(self, tokens: float, seqs: float) -> float:
        """max(weight streaming, matrix FLOPs) of a step of `tokens` rows and `seqs` LM-head rows."""
        flops = self.token_flops_s * tokens + self.seq_flops_s * seqs
        return flops if flops > self.weight_s else self.weight_s

    def communication(self, tokens: float) -> float:
        """The TP all-reduces of a step of `tokens` rows (0 at tp = 1)."""
        return self.comm_fixed_s + self.comm_token_s * tokens

    def fixed(self, tokens: float, seqs: float) -> float:
        """The part of a step's time no coefficient scales: matrices and TP all-reduces."""
        return self.matrices(tokens, seqs) + self.communication(tokens)


def decode_terms(
    physics: StepPhysics,
    split_kv: SplitKV,
    padded: int,
    num_context_tokens: int,
    max_seq_len: int,
    sync: bool = True,
) -> dict[str, float]:
    """The value of each DECODE_TERMS term of one decode step (padded batch `padded`)."""
    s = 1.0 if sync else 0.0
    splits = split_kv.divisor(padded, num_context_tokens, max_seq_len)
    return {
        "host_step": s,
        "host_row": s * padded,
        "host_entry": s * padded * max_seq_len / physics.block_size,
        "layer": float(physics.num_layers),
        "multi_row_layer": float(physics.num_layers) if padded > 1 else 0.0,
        "kv_read": (num_context_tokens + padded) * physics.kv_token_s,
        "longest_split": max_seq_len / splits * physics.split_token_s,
    }


def prefill_terms(physics: StepPhysics, batch: BatchShape) -> dict[str, float]:
    """The value of each PREFILL_TERMS term of one prefill or mixed step."""
    tokens, seqs = batch.total_num_scheduled_tokens, batch.num_seqs
    return {
        "host_step": 1.0,
        "host_seq": float(seqs),
        "host_entry": seqs * batch.max_seq_len / physics.block_size,
        "layer": float(physics.num_layers),
        "activation": tokens * physics.activation_token_s,
        "attention": batch.prefill_attn_work * physics.pair_s,
        "kv_read": (batch.num_context_tokens + tokens) * physics.kv_token_s,
    }


# ---- the model ----------------------------------------------------------------------------------
class TransferredModel(LatencyModelBase):
    """The transferred latency model of one configuration: `coefficients` (fitted on the reference
    GPU's step records) priced with the physics of `model` on `gpu` at `tp` and `block_size`.

    `split_kv`: the decode kernel's split rule (default: today's engine's, `engine_split_kv`).
    `max_graph_batch_size`: the largest decode CUDA graph (default: the engine's for 256 sequences).
    `overlapped`: the view for decode steps scheduled while the step before them ran (async
    scheduling): without the host terms. `profile` is None: this is no fitted profile (no fit ranges
    to count against); `band_errors()` gives its leave-one-out error.
    """

    profile = None
    target = "wall_time_s"  # the measured step time the coefficients were fitted on

    def __init__(
        self,
        coefficients: TransferCoefficients,
        model: ModelSpec,
        gpu: GpuSpec | str,
        tp: int = 1,
        block_size: int = 16,
        split_kv: SplitKV | None = None,
        max_graph_batch_size: int | None = None,
        source: str | Path | None = None,
        overlapped: bool = False,
    ) -> None:
        self.coefficients = c = coefficients
        self.model = model
        self.gpu = get_gpu(gpu)
        self.tp = tp
        self.block_size = block_size
        self.split_kv = split_kv or engine_split_kv(model, block_size, tp)
        self.max_graph_batch_size = (
            max_graph_batch_size if max_graph_batch_size is not None else _default_graph_max()
        )
        self.source = str(source) if source is not None else None
        self.overlapped = overlapped
        self.pinned = pinned = _pinned_for(self.gpu, c)
        self.physics = p = StepPhysics.of(model, self.gpu, tp, block_size, pinned, self.split_kv.num_sms)
        d, q = c.decode, c.prefill
        host = 0.0 if overlapped else 1.0
        self._h_step = host * d["host_step"]
        self._h_row = host * d["host_row"]
        self._h_entry = host * d["host_entry"] / block_size  # per row and token of the longest sequence
        self._layer = d["layer"] * p.num_layers
        self._multi = d["multi_row_layer"] * p.num_layers
        self._kv = d["kv_read"] * p.kv_token_s
        self._split = d["longest_split"] * p.split_token_s
        self._p_step = q["host_step"] + q["layer"] * p.num_layers
        self._p_seq = q["host_seq"]
        self._p_entry = q["host_entry"] / block_size
        self._p_act = q["activation"] * p.activation_token_s
        self._p_pair = q["attention"] * p.pair_s
        self._p_kv = q["kv_read"] * p.kv_token_s
        self._floor = {k: c.floors[k] * p.num_layers for k in FLOOR_KINDS}
        self._gmax = self.max_graph_batch_size
        self._balanced = self.split_kv.balanced
        self._base: dict[int, tuple[float, float]] = {}  # padded b -> (time of no tokens, per token of L)
        self._splits_of_b: dict[int, int] = {}  # unbalanced kernel: padded b -> splits
        self._split_consts: dict[int, tuple[int, int]] = {}  # balanced: padded b -> (unit, balance)
        self._split_memo: dict[tuple[int, int, int], int] = {}  # (b, units, target units) -> splits
        self._run_consts: dict[int, tuple[int, int, int, int]] = {}  # balanced: b -> split_run_consts
        self._overlapped_model: TransferredModel | None = None

    def __repr__(self) -> str:
        view = ", overlapped" if self.overlapped else ""
        return f"TransferredModel({self.model.name}, {self.gpu.name}, tp={self.tp}, block {self.block_size}{view})"

    def describe(self) -> str:
        return (
            f"transferred model ({Path(self.source).name if self.source else 'unsaved fit'}, fitted on "
            f"{self.coefficients.reference_gpu}) for {self.model.name} on {self.gpu.name} tp={self.tp} "
            f"block {self.block_size}"
        )

    def overlapped_model(self) -> TransferredModel:
        """This model for decode steps scheduled ahead: without the host terms."""
        if self.overlapped:
            return self
        if self._overlapped_model is None:
            self._overlapped_model = TransferredModel(
                self.coefficients,
                self.model,
                self.gpu,
                self.tp,
                self.block_size,
                self.split_kv,
                self.max_graph_batch_size,
                self.source,
                overlapped=True,
            )
        return self._overlapped_model

    def band_errors(self) -> tuple[float, float, str] | None:
        """(decode, prefill/mixed, what they are) relative step-time errors for a confidence band:
        the leave-one-out errors recorded with the fit, None when it records none."""
        loo = self.coefficients.leave_one_out
        if not loo:
            return None
        name = Path(self.source).name if self.source else "the transferred model"
        return (
            float(loo["decode"]),
            float(loo["prefill"]),
            f"{loo.get('what', 'leave-one-out error')} of {name}",
        )

    # ---- decode -------------------------------------------------------------------------------
    def _padded(self, num_seqs: int) -> int:
        return graph_padded_batch_size(num_seqs, self._gmax)

    def _base_of(self, b: int) -> tuple[float, float]:
        """(the decode time of a step of no context at padded batch b, host time per token of its
        longest sequence), memoised."""
        base = self._base.get(b)
        if base is None:
            p = self.physics
            fixed = self._h_step + self._h_row * b + self._layer + (self._multi if b > 1 else 0.0)
            fixed += p.matrices(b, b) + self._kv * b + p.communication(b)
            base = self._base[b] = (fixed, self._h_entry * b)
        return base

    def _splits(self, b: int, num_context_tokens: int, max_seq_len: int) -> int:
        """`split_kv.divisor(b, ...)`, memoised: a balanced step's splits depend on b, the longest
        sequence's split units and the step's target units per split only."""
        if not self._balanced:
            splits = self._splits_of_b.get(b)
            if splits is None:
                splits = self._splits_of_b[b] = self.split_kv.num_splits(b)
            return splits
        kv = self.split_kv
        consts = self._split_consts.get(b)
        if consts is None:
            grid = grid_splits(b, kv.num_kv_heads, kv.num_sms)
            consts = self._split_consts[b] = (
                split_unit(kv.split_block_size),
                balance_programs(kv.num_sms, True, grid),
            )
        unit, balance = consts
        units = (max_seq_len + unit - 1) // unit or 1
        target = target_split_units(num_context_tokens + b, kv.num_kv_heads, kv.split_block_size, balance)
        key = (b, units, target)
        splits = self._split_memo.get(key)
        if splits is None:
            splits = self._split_memo[key] = kv.divisor(b, num_context_tokens, max_seq_len)
        return splits

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        b = self._padded(num_seqs)
        base, entry = self._base_of(b)
        splits = self._splits(b, num_context_tokens, max_seq_len)
        return base + self._kv * num_context_tokens + (entry + self._split / splits) * max_seq_len

    def _leading_decode_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """The reference loop with `decode_step_time` inlined: its float operations, in its order,
        the longest split's coefficient (entry + split / splits) computed once a stretch of steps
        that keep their splits (`split_run`; all of the run where splits depend on b only)."""
        b = self._padded(num_seqs)
        base, entry = self._base_of(b)
        kv, split = self._kv, self._split
        times = [start]
        append = times.append
        # counts as floats: integers, exact (as in the int * float of decode_step_time)
        t, c, m, step = start, float(num_context_tokens), float(max_seq_len), float(num_seqs)
        consts = self._run_consts_of(b) if self._balanced else None
        ctx, length, left = num_context_tokens, max_seq_len, max_steps
        while left > 0 and t < deadline:
            if consts is None:
                splits, n = self._splits(b, ctx, length), left
            else:
                splits, hold = split_run(consts, b, ctx, length, num_seqs)
                n = hold if hold < left else left
            coef = entry + split / splits
            for _ in range(n):
                if t >= deadline:
                    break
                t = t + (base + kv * c + coef * m)
                append(t)
                c += step
                m += 1.0
            left -= n
            ctx += n * num_seqs
            length += n
        return times

    def _run_consts_of(self, b: int) -> tuple[int, int, int, int]:
        """`split_run_consts` of this model's balanced kernel at padded batch size `b`, memoised."""
        consts = self._run_consts.get(b)
        if consts is None:
            consts = self._run_consts[b] = split_run_consts(self.split_kv, b)
        return consts

    def _decode_step_array(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        b = self._padded(num_seqs)
        base, entry = self._base_of(b)
        context = arange_int64(num_context_tokens, num_steps, num_seqs)
        lengths = arange_int64(max_seq_len, num_steps, 1)
        if self._balanced:
            splits = self.split_kv.divisors(b, context, lengths)
        else:
            splits = np.full(num_steps, self._splits(b, 0, 0), dtype=np.int64)
        steps = context * self._kv
        steps += base  # decode_step_time's order: (base + kv * ctx) + (entry + split / splits) * L
        steps += (entry + self._split / splits) * lengths
        return steps

    def _decode_parts(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int
    ) -> tuple[float, float, float, float]:
        b = self._padded(num_seqs)
        p = self.physics
        splits = self._splits(b, num_context_tokens, max_seq_len)
        linear = p.matrices(b, b)
        attention = self._kv * (num_context_tokens + b) + self._split / splits * max_seq_len
        comm = p.communication(b)
        overhead = self._h_step + self._h_row * b + self._layer + (self._multi if b > 1 else 0.0)
        overhead += self._h_entry * b * max_seq_len
        return linear, attention, comm, overhead

    # ---- prefill and mixed --------------------------------------------------------------------
    def _predict_prefill(self, batch: BatchShape) -> StepTime:
        p = self.physics
        tokens, seqs = batch.total_num_scheduled_tokens, batch.num_seqs
        linear = p.matrices(tokens, seqs) + self._p_act * tokens
        attention = self._p_pair * batch.prefill_attn_work + self._p_kv * (batch.num_context_tokens + tokens)
        comm = p.communication(tokens)
        overhead = self._p_step + self._p_seq * seqs + self._p_entry * seqs * batch.max_seq_len
        total = linear + attention + comm + overhead
        floor = self._floor["mixed" if batch.kind == "mixed" else "prefill"]
        if total < floor:  # host-bound: the time below the floor is host overhead
            return StepTime(linear, attention, comm, overhead + (floor - total), floor)
        return StepTime(linear, attention, comm, overhead, total)


def _default_graph_max() -> int:
    return max_graph_batch_size(DEFAULT_MAX_NUM_SEQS)


def _pinned_for(gpu: GpuSpec, coefficients: TransferCoefficients) -> Pinned:
    """The pinned efficiencies on `gpu`: its own measured ceilings where gpus.json has them, else
    the reference GPU's (the fit's)."""
    try:
        return Pinned.of_gpu(gpu)
    except ValueError:
        return coefficients.pinned


def load_transferred_model(
    path: str | Path,
    model: ModelSpec,
    gpu: GpuSpec | str,
    tp: int = 1,
    block_size: int | None = None,
    split_kv: SplitKV | None = None,
    max_graph_batch_size: int | None = None,
) -> TransferredModel:
    """The transferred model of a configuration from a coefficients file."""
    if block_size is None:
        raise ValueError("block_size: the transferred model prices a block size; pass one")
    coefficients = TransferCoefficients.load(path)
    return TransferredModel(
        coefficients, model, gpu, tp, block_size, split_kv, max_graph_batch_size, source=path
    )


# ---- fitting ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordSet:
    """Step records of one profiling sweep and what they were measured on: the model, block size,
    TP, decode kernel split rule, largest decode graph, and whether the engine scheduled
    asynchronously. `name` names the records file."""

    name: str
    frame: pd.DataFrame
    model: ModelSpec
    block_size: int
    split_kv: SplitKV
    max_graph_batch_size: int
    tp: int = 1
    async_scheduling: bool = False
    gpu: str = "H200"

    @classmethod
    def of_profile(cls, profile_path: str | Path, records_dir: str | Path | None = None) -> RecordSet:
        """The records a shipped profile was fitted on (`extra["records"]`, under `records_dir`,
        default the profile's folder's records/), with the profile's description of the engine
        (its fitted coefficients are not used)."""
        from simulator.latency.profile import LatencyProfile

        path = Path(profile_path)
        profile = LatencyProfile.load(path)
        name = profile.extra.get("records")
        if not name:
            raise ValueError(f"{path}: names no step records (extra.records)")
        folder = Path(records_dir) if records_dir is not None else path.parent / "records"
        frame = pd.read_parquet(folder / Path(str(name)).name)
        model = profile.model_spec()
        split = profile.split_kv
        if split is None:
            raise ValueError(
                f"{path}: its decode kernel does not split KV (no split_kv); not a Triton-decode sweep"
            )
        return cls(
            name=Path(str(name)).name,
            frame=frame,
            model=model,
            block_size=profile.block_size,
            split_kv=split,
            max_graph_batch_size=profile.max_graph_batch_size,
            tp=profile.tp,
            async_scheduling=bool(profile.extra.get("async_scheduling", False)),
            gpu=canonical_gpu_name(profile.gpu),
        )

    @property
    def model_name(self) -> str:
        return self.model.name

    def usable(self) -> pd.DataFrame:
        """Steps to fit: not compiled, not empty."""
        f = self.frame
        keep = (f["kind"].astype(str) != "empty").to_numpy()
        if "compiled" in f:
            keep = keep & ~f["compiled"].fillna(False).astype(bool).to_numpy()
        return f[keep].reset_index(drop=True)


def _sync_column(frame: pd.DataFrame) -> np.ndarray:
    if "overlapped" not in frame:
        return np.ones(len(frame), dtype=bool)
    return ~frame["overlapped"].fillna(False).astype(bool).to_numpy()


def _design(rs: RecordSet, pinned: Pinned, gpu: GpuSpec) -> dict[str, Any]:
    """Per kind, the terms' values (`decode_terms`, `prefill_terms`: columns as DECODE_TERMS /
    PREFILL_TERMS), the pinned matrix and TP time (not fitted) and the measured wall time of a
    record set's usable steps."""
    from simulator.latency.base import StepShape

    physics = StepPhysics.of(rs.model, gpu, rs.tp, rs.block_size, pinned, rs.split_kv.num_sms)
    f = rs.usable()
    kind = f["kind"].astype(str).to_numpy()
    y = f["wall_time_s"].to_numpy(dtype=np.float64)
    dec = kind == "decode"
    d = f[dec]
    rows_dec, fixed_dec = [], []
    for n, ctx, length, sync in zip(
        d["num_seqs"].to_numpy(dtype=np.int64),
        d["num_context_tokens"].to_numpy(dtype=np.int64),
        d["max_seq_len"].to_numpy(dtype=np.int64),
        _sync_column(d),
    ):
        b = graph_padded_batch_size(int(n), rs.max_graph_batch_size)
        terms = decode_terms(physics, rs.split_kv, b, int(ctx), int(length), bool(sync))
        rows_dec.append([terms[t] for t in DECODE_TERMS])
        fixed_dec.append(physics.fixed(b, b))
    rows_pre, fixed_pre = [], []
    for row in f[~dec].to_dict("records"):
        shape = StepShape.of(row)
        terms = prefill_terms(physics, shape)
        rows_pre.append([terms[t] for t in PREFILL_TERMS])
        fixed_pre.append(physics.fixed(shape.total_num_scheduled_tokens, shape.num_seqs))
    return {
        "x_dec": np.array(rows_dec, dtype=np.float64).reshape(-1, len(DECODE_TERMS)),
        "fixed_dec": np.array(fixed_dec, dtype=np.float64),
        "y_dec": y[dec],
        "x_pre": np.array(rows_pre, dtype=np.float64).reshape(-1, len(PREFILL_TERMS)),
        "fixed_pre": np.array(fixed_pre, dtype=np.float64),
        "y_pre": y[~dec],
        "kind_pre": kind[~dec],
        "layers_pre": np.full(int((~dec).sum()), float(physics.num_layers)),
    }


def _solve(x: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    if loss == "median":
        return _least_absolute_nnls(x, y)
    return _weighted_nnls(x, y, 1.0 / y if loss == "relative" else None)


def _rel_errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = np.abs(predicted - measured) / measured
    return {
        "steps": int(len(rel)),
        "median": float(np.median(rel)) if len(rel) else float("nan"),
        "p90": float(np.quantile(rel, 0.9)) if len(rel) else float("nan"),
        "summed": float(predicted.sum() / measured.sum() - 1.0) if len(rel) else float("nan"),
    }


def fit_transfer(
    record_sets: list[RecordSet],
    gpu: GpuSpec | str = "H200",
    loss: str = "median",
    pinned: Pinned | None = None,
    floors: bool = True,
) -> TransferCoefficients:
    """Fit the transferred model's coefficients on `record_sets` (all measured on `gpu`): one
    non-negative fit of the decode terms, one of the prefill/mixed terms (the pinned matrix and TP
    times subtracted from the measured wall times), then the per-layer host floors of prefill and
    mixed steps (`fit_floor`, same loss). `pinned`: default the GPU's measured ceilings."""
    if not record_sets:
        raise ValueError("record_sets: nothing to fit")
    if loss not in LOSSES:
        raise ValueError(f"loss: {loss!r} is not one of {list(LOSSES)}")
    spec = get_gpu(gpu)
    for rs in record_sets:
        if canonical_gpu_name(rs.gpu) != spec.name:
            raise ValueError(f"{rs.name}: measured on {rs.gpu}, not {spec.name}")
    pinned = pinned or Pinned.of_gpu(spec)
    designs = [_design(rs, pinned, spec) for rs in record_sets]
    stack = {k: np.concatenate([d[k] for d in designs]) for k in designs[0]}
    c_dec = _solve(stack["x_dec"], stack["y_dec"] - stack["fixed_dec"], loss)
    c_pre = _solve(stack["x_pre"], stack["y_pre"] - stack["fixed_pre"], loss)
    predicted_pre = stack["x_pre"] @ c_pre + stack["fixed_pre"]
    floor = dict.fromkeys(FLOOR_KINDS, 0.0)
    if floors:
        layers = stack["layers_pre"]
        for kind in FLOOR_KINDS:
            rows = stack["kind_pre"] == kind
            if rows.any():
                floor[kind] = fit_floor(
                    predicted_pre[rows] / layers[rows], stack["y_pre"][rows] / layers[rows], loss
                )
    coefficients = TransferCoefficients(
        decode={t: float(v) for t, v in zip(DECODE_TERMS, c_dec)},
        prefill={t: float(v) for t, v in zip(PREFILL_TERMS, c_pre)},
        floors=floor,
        pinned=pinned,
        reference_gpu=spec.name,
    )
    errors = {rs.name: record_errors(coefficients, rs) for rs in record_sets}
    return TransferCoefficients(
        coefficients.decode,
        coefficients.prefill,
        coefficients.floors,
        pinned,
        spec.name,
        extra={
            "fit": {
                "loss": loss,
                "target": "wall_time_s",
                "records": [
                    {
                        "file": rs.name,
                        "model": rs.model_name,
                        "block_size": rs.block_size,
                        "async_scheduling": rs.async_scheduling,
                        "steps": int(len(rs.usable())),
                    }
                    for rs in record_sets
                ],
                "training_error": errors,
            }
        },
    )


def model_for_records(coefficients: TransferCoefficients, rs: RecordSet) -> TransferredModel:
    """The transferred model of the configuration a record set was measured on (its kernel and graphs)."""
    return TransferredModel(
        coefficients, rs.model, rs.gpu, rs.tp, rs.block_size, rs.split_kv, rs.max_graph_batch_size
    )


def predict_records(coefficients: TransferCoefficients, rs: RecordSet) -> pd.DataFrame:
    """The record set's usable steps with `predicted_s` (overlapped steps on the overlapped view)
    and `measured_s` (wall time)."""
    from simulator.latency.base import StepShape

    latency = model_for_records(coefficients, rs)
    ahead = latency.overlapped_model()
    f = rs.usable()
    sync = _sync_column(f)
    predicted = [
        (latency if s else ahead).predict(StepShape.of(row)).total
        for row, s in zip(f.itertuples(index=False), sync)
    ]
    return pd.DataFrame(
        {
            "kind": f["kind"].astype(str).to_numpy(),
            "predicted_s": predicted,
            "measured_s": f["wall_time_s"].to_numpy(),
        }
    )


def record_errors(coefficients: TransferCoefficients, rs: RecordSet) -> dict[str, dict[str, float]]:
    """Relative step-time errors on a record set: decode and prefill/mixed steps."""
    frame = predict_records(coefficients, rs)
    out = {}
    for label, rows in (("decode", frame["kind"] == "decode"), ("prefill", frame["kind"] != "decode")):
        sub = frame[rows]
        out[label] = _rel_errors(sub["predicted_s"].to_numpy(), sub["measured_s"].to_numpy())
    return out


# ---- leave one out ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeaveOneOut:
    """A transfer to prove: fit on the record sets whose `axis` is `train`, predict those (and the
    replays) whose `axis` is `test`. axis: 'model' (model name), 'block_size' or 'async_scheduling'."""

    name: str
    axis: str
    train: Any
    test: Any

    def side(self, value: Any) -> str | None:
        """'train', 'test' or None for a configuration whose `axis` has `value`."""
        if value == self.train:
            return "train"
        if value == self.test:
            return "test"
        return None

    def of(self, rs: RecordSet) -> str | None:
        return self.side(getattr(rs, self.axis) if self.axis != "model" else rs.model_name)


LEAVE_ONE_OUT = (
    LeaveOneOut("Qwen3-0.6B -> Qwen3-8B", "model", "qwen3-0.6b", "qwen3-8b"),
    LeaveOneOut("block 16 -> block 256", "block_size", 16, 256),
    LeaveOneOut("sync -> async", "async_scheduling", False, True),
)


def leave_one_out_errors(
    record_sets: list[RecordSet], gpu: GpuSpec | str = "H200", loss: str = "median"
) -> dict[str, Any]:
    """Per LEAVE_ONE_OUT pair: a fit on its training record sets, its errors on the other side's
    record sets (step times, by kind); and the band's figures: the largest p90 of each kind over the
    pairs."""
    pairs = []
    for pair in LEAVE_ONE_OUT:
        train = [rs for rs in record_sets if pair.of(rs) == "train"]
        test = [rs for rs in record_sets if pair.of(rs) == "test"]
        if not train or not test:
            continue
        fit = fit_transfer(train, gpu, loss)
        pairs.append(
            {
                "pair": pair.name,
                "fitted_on": [rs.name for rs in train],
                "errors": {rs.name: record_errors(fit, rs) for rs in test},
            }
        )
    if not pairs:
        return {}
    worst = {
        kind: max(e[kind]["p90"] for p in pairs for e in p["errors"].values())
        for kind in ("decode", "prefill")
    }
    return {
        "what": "largest leave-one-out p90 relative step-time error",
        "decode": worst["decode"],
        "prefill": worst["prefill"],
        "pairs": pairs,
    }


# ---- the shipped fit ----------------------------------------------------------------------------
def shipped_record_sets(profile_dir: str | Path | None = None) -> list[RecordSet]:
    """The H200 profiling sweeps of today's decode kernel (the Triton split-KV kernel) that ship beside
    the fitted profiles: every profile's records but those of the first engine (FlashAttention-4
    decode, no split rule)."""
    from simulator.defaults import SHIPPED_PROFILE_DIR
    from simulator.latency.profile import PROFILE_FORMAT

    folder = Path(profile_dir) if profile_dir is not None else SHIPPED_PROFILE_DIR
    out = []
    for path in sorted(folder.glob("*.json")):
        raw = json.loads(path.read_text())
        if (
            raw.get("format") != PROFILE_FORMAT
            or not raw.get("split_kv")
            or not raw.get("extra", {}).get("records")
        ):
            continue
        out.append(RecordSet.of_profile(path))
    return out


def fit_shipped(
    out: str | Path, profile_dir: str | Path | None = None, loss: str = "median"
) -> TransferCoefficients:
    """Fit on every shipped sweep (`shipped_record_sets`), record the leave-one-out errors, save."""
    sets = shipped_record_sets(profile_dir)
    fit = fit_transfer(sets, loss=loss)
    extra = {
        **fit.extra,
        "leave_one_out": leave_one_out_errors(sets, loss=loss),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "command": "python -m simulator.latency.transfer --out " + str(out),
        "communication": "TP all-reduces priced as the roofline's (RooflineEfficiency defaults): no TP records fitted",
    }
    coefficients = TransferCoefficients(
        fit.decode, fit.prefill, fit.floors, fit.pinned, fit.reference_gpu, extra
    )
    coefficients.save(out)
    return coefficients


def main(argv: list[str] | None = None) -> int:
    """`python -m simulator.latency.transfer --out FILE`: fit the transferred model on the shipped
    sweeps, with its leave-one-out errors, and print its coefficients."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m simulator.latency.transfer", description=main.__doc__)
    parser.add_argument("--out", required=True, help="coefficients file to write (JSON)")
    parser.add_argument(
        "--profiles", default=None, help="folder of fitted profiles with records/ (default: the shipped)"
    )
    parser.add_argument("--loss", default="median", choices=LOSSES)
    args = parser.parse_args(argv)
    c = fit_shipped(args.out, args.profiles, args.loss)
    print(format_coefficients(c))
    return 0


def format_coefficients(c: TransferCoefficients) -> str:
    lines = [f"transferred model fitted on {c.reference_gpu} ({c.pinned.source})"]
    lines.append("  decode:  " + ", ".join(f"{t} {c.decode[t]:.4g}" for t in DECODE_TERMS))
    lines.append("  prefill: " + ", ".join(f"{t} {c.prefill[t]:.4g}" for t in PREFILL_TERMS))
    lines.append("  floors per layer: " + ", ".join(f"{k} {c.floors[k] * 1e6:.1f} us" for k in FLOOR_KINDS))
    loo = c.leave_one_out
    if loo:
        lines.append(f"  {loo['what']}: decode {loo['decode']:.1%}, prefill/mixed {loo['prefill']:.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
