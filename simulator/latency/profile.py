"""Latency profiles: a fitted model's coefficients plus what they were measured on, as JSON.

`LatencyProfile` saves/loads one fit with its metadata (model shapes, GPU, TP, block size, engine
settings, fit error) and refuses to be used for another configuration. `load_latency_model` picks a
profile's `FittedModel` or, without a profile, the analytic `RooflineModel`. No fitting here.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from engine.model_spec import ModelSpec
from simulator.latency.base import LatencyModel
from simulator.latency.fitted import (
    STEP_FLOOR_KINDS,
    AttnSpan,
    FitError,
    FittedModel,
    LinearFit,
    SplitKV,
    StepFloors,
    fit_step_records,
)
from simulator.latency.gpus import GpuSpec, canonical_gpu_name
from simulator.latency.ranges import FitRanges
from simulator.latency.roofline import RooflineEfficiency, RooflineModel

PROFILE_FORMAT = "kvplan.latency_profile"
PROFILE_VERSION = 1
# ModelSpec fields that decide step times; the name and tokenizer details do not.
SHAPE_FIELDS = (
    "architecture",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "dtype",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class LatencyProfile:
    """One fitted latency model and the configuration it was measured on."""

    model: dict[str, Any]  # ModelSpec fields
    gpu: str
    tp: int
    block_size: int
    dtype: str
    attention_backend: str
    engine_version: str
    num_kv_blocks: int | None  # KV blocks of the calibration's cache (a fact of the sweep, not a default)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_graph_batch_size: int  # largest decode CUDA graph (0 = eager)
    target: str  # measured column fitted: gpu_time_s or wall_time_s
    num_records: int  # step records fitted or held back (compiled ones excluded)
    decode: LinearFit
    prefill: LinearFit
    created: str = ""  # ISO 8601 UTC
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (trace, seed, ...)
    split_kv: SplitKV | None = None  # how the decode kernel split each sequence's KV (None: it did not)
    floors: StepFloors | None = None  # host floor per step kind (None: profiles fitted without floors)
    attn_span: AttnSpan | None = None  # the prefill kernel's geometry of a fit with the span term

    @property
    def model_name(self) -> str:
        return str(self.model.get("name", "?"))

    @property
    def calibration_num_kv_blocks(self) -> int | None:
        """KV blocks of the cache the step records were measured with: `num_kv_blocks`, or the
        `extra` entry of profiles that leave it unset. A condition of the calibration: simulations
        size their cache from the GPU's memory (simulator.config.kv_blocks_per_replica)."""
        if self.num_kv_blocks:
            return int(self.num_kv_blocks)
        recorded = self.extra.get("calibration_num_kv_blocks")
        return int(recorded) if recorded else None

    def model_spec(self) -> ModelSpec:
        return ModelSpec(**self.model)

    def describe(self) -> str:
        return f"{self.model_name} on {self.gpu} tp={self.tp} block {self.block_size}"

    def to_latency_model(self) -> FittedModel:
        """The profile's FittedModel; its `.profile` is this profile."""
        return FittedModel(
            self.decode,
            self.prefill,
            self.max_graph_batch_size,
            profile=self,
            split_kv=self.split_kv,
            floors=self.floors,
            block_size=self.block_size,
            attn_span=self.attn_span,
        )

    # ---- compatibility ----------------------------------------------------------------------------
    def check_compatible(
        self,
        model: ModelSpec | str | None = None,
        gpu: GpuSpec | str | None = None,
        tp: int | None = None,
        block_size: int | None = None,
        dtype: str | None = None,
    ) -> None:
        """Raise ValueError listing every way the asked configuration differs from the profile's.

        A ModelSpec matches on its shapes (SHAPE_FIELDS), whatever its name; a bare name matches
        the profile's model name, case-insensitively. Arguments left None are not checked.
        """
        problems: list[str] = []
        asked: list[str] = []
        if model is not None:
            name = model if isinstance(model, str) else model.name
            asked.append(name)
            if isinstance(model, str):
                if model.strip().lower() != self.model_name.lower():
                    problems.append(f"model {self.model_name} != {model}")
            else:
                diffs = [
                    f"{f} {self.model.get(f)} != {getattr(model, f)}"
                    for f in SHAPE_FIELDS
                    if self.model.get(f) != getattr(model, f)
                ]
                if diffs:
                    names = self.model_name if name == self.model_name else f"{self.model_name} != {name}"
                    problems.append(f"model {names} ({', '.join(diffs)})")
        if gpu is not None:
            gpu_name = canonical_gpu_name(gpu)
            asked.append(f"on {gpu_name}")
            if gpu_name.lower() != canonical_gpu_name(self.gpu).lower():
                problems.append(f"gpu {self.gpu} != {gpu_name}")
        if tp is not None:
            asked.append(f"tp={tp}")
            if tp != self.tp:
                problems.append(f"tp {self.tp} != {tp}")
        if block_size is not None:
            asked.append(f"block {block_size}")
            if block_size != self.block_size:
                problems.append(f"block_size {self.block_size} != {block_size}")
        if dtype is not None:
            asked.append(f"dtype {dtype}")
            if dtype != self.dtype:
                problems.append(f"dtype {self.dtype} != {dtype}")
        if problems:
            raise ValueError(
                f"profile is for {self.describe()}; asked for {' '.join(asked)}: mismatched "
                + "; ".join(problems)
            )

    # ---- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, LinearFit):
                value = {
                    "features": list(value.features),
                    "coefficients": list(value.coefficients),
                    "fit_error": dataclasses.asdict(value.error) if value.error else None,
                }
            elif isinstance(value, (SplitKV, AttnSpan)):
                value = value.as_dict()
            elif isinstance(value, StepFloors):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "profile") -> LatencyProfile:
        if raw.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"{where}: not a latency profile (format {raw.get('format')!r}, expected {PROFILE_FORMAT!r})"
            )
        if raw.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"{where}: profile version {raw.get('version')!r} is not supported (expected {PROFILE_VERSION})"
            )
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise ValueError(f"{where}: missing field {f.name!r}")
            value = raw[f.name]
            if f.name in ("decode", "prefill"):
                try:
                    err = value.get("fit_error")
                    value = LinearFit(
                        tuple(value["features"]),
                        tuple(float(c) for c in value["coefficients"]),
                        FitError(**err) if err else None,
                    )
                except (KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"{where}: field {f.name!r} is malformed ({e})") from None
            elif f.name == "split_kv" and value is not None:
                value = _split_kv_from_dict(value, where)
            elif f.name == "floors" and value is not None:
                value = _floors_from_dict(value, where)
            elif f.name == "attn_span" and value is not None:
                value = _attn_span_from_dict(value, where)
            kwargs[f.name] = value
        profile = cls(**kwargs)
        profile.to_latency_model()  # validates feature lists now rather than at first use
        return profile

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no latency profile here")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw, where=str(path))
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None

    # ---- construction from a fit ------------------------------------------------------------------
    @classmethod
    def from_fit(
        cls,
        fitted: FittedModel,
        *,
        model: ModelSpec,
        gpu: GpuSpec | str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        tp: int | None = None,
        block_size: int | None = None,
        attention_backend: str = "",
        engine_version: str = "",
        num_kv_blocks: int | None = None,
        created: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> LatencyProfile:
        """Wrap a fit with its metadata. tp and block_size default to the records' values and must
        agree with them when both are known."""
        summary = fitted.summary
        for name, given in (("tp", tp), ("block_size", block_size)):
            recorded = getattr(summary, name) if summary else None
            if given is not None and recorded is not None and given != recorded:
                raise ValueError(f"{name}: given {given} but the step records say {recorded}")
        tp = tp if tp is not None else (summary.tp if summary else None)
        block_size = block_size if block_size is not None else (summary.block_size if summary else None)
        if tp is None or block_size is None:
            raise ValueError("tp and block_size: not in the step records; pass them")
        return cls(
            model=dataclasses.asdict(model),
            gpu=canonical_gpu_name(gpu),
            tp=int(tp),
            block_size=int(block_size),
            dtype=model.dtype,
            attention_backend=attention_backend,
            engine_version=engine_version,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_graph_batch_size=fitted.max_graph_batch_size,
            target=summary.target if summary else "",
            num_records=summary.num_used if summary else 0,
            decode=fitted.decode,
            prefill=fitted.prefill,
            split_kv=fitted.split_kv,
            floors=fitted.floors,
            attn_span=fitted.attn_span,
            created=created or _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            extra=dict(extra or {}),
        )


def fit_profile(
    records: pd.DataFrame,
    *,
    model: ModelSpec,
    gpu: GpuSpec | str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tp: int | None = None,
    block_size: int | None = None,
    attention_backend: str = "",
    engine_version: str = "",
    num_kv_blocks: int | None = None,
    max_graph_batch_size: int | None = None,
    target: str = "auto",
    holdout_fraction: float = 0.25,
    seed: int = 0,
    loss: str = "absolute",
    created: str | None = None,
    extra: dict[str, Any] | None = None,
    split_kv: SplitKV | None = None,
    floors: bool = True,
    host_table: bool = True,
    prefix_hits: bool = False,
    span: bool = False,
) -> LatencyProfile:
    """Calibrate: fit step records (`fit_step_records`) and wrap the fit as a profile. `span`: with
    the span term (SPAN_FEATURES), its geometry from `model`, `tp` and `split_kv`'s SMs."""
    fitted = fit_step_records(
        records,
        split_kv=split_kv,
        floors=floors,
        host_table=host_table,
        prefix_hits=prefix_hits,
        attn_span=span_geometry(model, tp or 1, split_kv) if span else None,
        max_num_seqs=max_num_seqs,
        max_graph_batch_size=max_graph_batch_size,
        target=target,
        holdout_fraction=holdout_fraction,
        seed=seed,
        loss=loss,
    )
    return LatencyProfile.from_fit(
        fitted,
        model=model,
        gpu=gpu,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        tp=tp,
        block_size=block_size,
        attention_backend=attention_backend,
        engine_version=engine_version,
        num_kv_blocks=num_kv_blocks,
        created=created,
        # the fit's own settings win over provenance copied from another profile (`kvplan fit --like`)
        extra={
            **(extra or {}),
            "seed": seed,
            "holdout_fraction": holdout_fraction,
            "loss": loss,
            # what the fit saw, for the simulator's extrapolation count (simulator/latency/ranges.py)
            "fit_ranges": FitRanges.of_records(records, str((extra or {}).get("records", ""))).as_dict(),
        },
    )


def refit_like(records: pd.DataFrame, like: LatencyProfile, **options: Any) -> LatencyProfile:
    """`fit_profile` of `records` with `like`'s model, GPU, TP, block size, limits and engine labels
    (`kvplan fit --like`); `options`: the fit's own (target, loss, split_kv, floors, extra, ...)."""
    return fit_profile(
        records,
        model=like.model_spec(),
        gpu=like.gpu,
        max_num_seqs=like.max_num_seqs,
        max_num_batched_tokens=like.max_num_batched_tokens,
        tp=like.tp,
        block_size=like.block_size,
        attention_backend=like.attention_backend,
        engine_version=like.engine_version,
        num_kv_blocks=like.num_kv_blocks,
        **options,
    )


def load_latency_model(
    profile_path: str | Path | None,
    model: ModelSpec,
    gpu: GpuSpec | str,
    tp: int = 1,
    block_size: int | None = None,
    *,
    efficiency: RooflineEfficiency | None = None,
) -> LatencyModel:
    """The latency model for a configuration: the profile's `FittedModel` (after checking that the
    profile matches model, gpu, tp and block_size; the loaded profile is its `.profile`), the
    `TransferredModel` of a transferred model's coefficients file (any configuration), or, with no
    profile, a `RooflineModel`."""
    if profile_path is None:
        return RooflineModel(model, gpu, tp=tp, efficiency=efficiency)
    if efficiency is not None:
        raise ValueError("efficiency: applies to the roofline model only, not to a fitted profile")
    from simulator.latency.transfer import is_transfer_file, load_transferred_model

    if is_transfer_file(profile_path):
        return load_transferred_model(profile_path, model, gpu, tp, block_size)
    profile = LatencyProfile.load(profile_path)
    try:
        profile.check_compatible(model=model, gpu=gpu, tp=tp, block_size=block_size)
    except ValueError as e:
        raise ValueError(f"{profile_path}: {e}") from None
    return profile.to_latency_model()


def _split_kv_from_dict(value: Any, where: str) -> SplitKV:
    keys = {"num_kv_heads", "num_sms"}
    balanced = keys | {"block_size", "balanced"}
    if not isinstance(value, dict) or set(value) not in (keys, balanced, balanced | {"split_tokens"}):
        raise ValueError(
            f"{where}: field 'split_kv' must be null, {{num_kv_heads, num_sms}} or "
            f"{{num_kv_heads, num_sms, block_size, balanced[, split_tokens]}}, got {value!r}"
        )
    try:
        return SplitKV(**value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def span_geometry(model: ModelSpec, tp: int, split_kv: SplitKV | None) -> AttnSpan:
    """The `AttnSpan` of `model` at TP `tp` on the GPU whose SMs `split_kv` counts (the fitted
    model's only record of them: a span term needs the engine's split-KV decode kernel)."""
    if split_kv is None:
        raise ValueError(
            "span term: needs the GPU's SM count, which only split_kv records (no split-KV kernel here)"
        )
    if model.num_kv_heads % tp:  # (ModelSpec checks that kv heads divide the query heads)
        raise ValueError(f"span term: {model.num_kv_heads} kv heads do not divide over tp {tp}")
    return AttnSpan(model.num_kv_heads // tp, model.num_heads // model.num_kv_heads, split_kv.num_sms)


def _attn_span_from_dict(value: Any, where: str) -> AttnSpan:
    if not isinstance(value, dict) or set(value) != {"num_kv_heads", "num_q_per_kv", "num_sms", "tile_rows"}:
        raise ValueError(
            f"{where}: field 'attn_span' must be null or {{num_kv_heads, num_q_per_kv, num_sms, tile_rows}}, got {value!r}"
        )
    try:
        return AttnSpan(**value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _floors_from_dict(value: Any, where: str) -> StepFloors:
    if not isinstance(value, dict) or not set(value) <= set(STEP_FLOOR_KINDS):
        raise ValueError(
            f"{where}: field 'floors' must be null or seconds by step kind {list(STEP_FLOOR_KINDS)}, got {value!r}"
        )
    try:
        return StepFloors(**value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_profile_file(name: str | Path, flag: str = "--profile") -> Path:
    """`name` as a profile path, or ValueError naming `flag` when it is no file of a JSON object."""
    path = Path(name)
    if not path.is_file():
        choices = " (give a profile JSON, 'auto' or 'roofline')" if flag == "--profile" else ""
        raise ValueError(f"{flag}: {path} does not exist{choices}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: {path} is not a latency profile: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{flag}: {path} is not a latency profile: a JSON {type(raw).__name__}, not an object"
        )
    return path


def profile_report(profile) -> str:
    """A fitted profile in a few lines: what it was fitted on, each fit's held-back error, its floors."""
    lines = [f"profile {profile.describe()}: {profile.num_records} steps fitted on {profile.target}"]
    for kind in ("decode", "prefill"):
        err = getattr(profile, kind).error
        if err is not None:
            lines.append(
                f"  {kind:<8} held-back error: median {err.median_rel_error:.1%}, p90 {err.p90_rel_error:.1%} "
                f"({err.n_test} held back of {err.n_train + err.n_test})"
            )
    table = dict(zip(profile.decode.features, profile.decode.coefficients)).get("sync_x_table_entries")
    if table is not None:
        lines.append(
            f"  host table term: {table * 1e9:.1f} ns a block-table entry (decode steps not scheduled ahead)"
        )
    prefix = dict(zip(profile.prefill.features, profile.prefill.coefficients)).get("total_num_cached_tokens")
    if prefix is not None:
        lines.append(
            f"  prefix-hit term: {prefix * 1e9:.1f} ns a cached prompt token (prefill and mixed steps)"
        )
    span = dict(zip(profile.prefill.features, profile.prefill.coefficients)).get("attn_span")
    if span is not None:
        lines.append(
            f"  span term: {span * 1e9:.1f} ns a key of the longest sequence beyond the step's keys per SM"
        )
    floors = getattr(profile, "floors", None)
    if floors is not None:
        lines.append(
            f"  host floors: decode {floors.decode * 1e3:.2f} ms, prefill {floors.prefill * 1e3:.2f} ms, "
            f"mixed {floors.mixed * 1e3:.2f} ms"
        )
    return "\n".join(lines)
