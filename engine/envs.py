"""Every environment variable the engine reads, in one registry (`VARIABLES`): name, kind, default,
allowed values and what it switches. `get(name)` is the one accessor; a bad value is a ValueError
naming the variable and what it allows. No engine, simulator, trace or benchmark module reads a
KVPLAN_* variable otherwise (tests/engine/test_envs.py scans for reads; the dashboard's own
settings, KVPLAN_DASHBOARD_* and KVPLAN_VALIDATION_DIR, are still read in dashboard/).

The kernel switches are read once, when an engine starts, into a frozen `KernelConfig`
(`KernelConfig.from_env`, explicit arguments winning). The engine hands it to its attention backend
and model runner; the runner resolves it for its device (`engine.model_runner.resolve_kernels`:
what runs) and keeps it active (`KernelConfig.activate`) while it launches kernels, so a kernel
reads a call-time switch through `current(field)`. Outside an engine (a benchmark or test calling a
kernel directly), `current` reads the environment. `LLM.kernel_choices()`, stored with step
records, replays and profiles, is the resolved config's `record()`.

`python -m engine.envs --markdown` prints the README's table of engine settings. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

SWITCH, CHOICE, PORT, RANK_STEP = "switch", "choice", "port", "rank_step"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. `kind`: SWITCH ("1" / "0": True / False), CHOICE (one of `choices`),
    PORT (an integer 0-65535) or RANK_STEP ("RANK:STEP": a (rank, step) pair). Unset or empty, it
    takes `default`. `doc`: what it switches; `notes`: a word on some values (the README's table);
    `field`: the KernelConfig field it sets (None: read where it is used); `public`: listed in the
    README (tests-only variables are not)."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()
    field: str | None = None
    public: bool = True

    def allowed(self) -> str:
        """What the variable allows, as its error message says it."""
        if self.kind == SWITCH:
            return "0 or 1"
        if self.kind == CHOICE:
            return f"one of {list(self.choices)}"
        if self.kind == PORT:
            return "a port number (0 to 65535)"
        return "RANK:STEP (two integers)"

    def parse(self, raw: str) -> Any:
        """The value of the (stripped, non-empty) setting `raw`; ValueError naming the variable."""
        if self.kind == SWITCH and raw in ("0", "1"):
            return raw == "1"
        if self.kind == CHOICE and raw in self.choices:
            return raw
        if self.kind == PORT and raw.isdigit() and int(raw) <= 65535:
            return int(raw)
        if self.kind == RANK_STEP:
            parts = raw.split(":")
            if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
                return int(parts[0]), int(parts[1])
        raise ValueError(f"{self.name}: {raw!r} is not {self.allowed()}")

    def values_markdown(self) -> str:
        """The README's "values (default first)" cell."""
        notes = dict(self.notes)
        if self.kind == SWITCH:
            values = ["1", "0"] if self.default else ["0", "1"]
        elif self.kind == CHOICE:
            values = [self.default, *(c for c in self.choices if c != self.default)]
        else:
            values = []
        cells = [f"`{v}`" + (f" ({notes[v]})" if v in notes else "") for v in values]
        if self.kind == PORT:
            cells = [f"unset ({notes['unset']})" if "unset" in notes else "unset", "`0`–`65535`"]
        return ", ".join(cells)


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "KVPLAN_DECODE_KERNEL", CHOICE, "auto",
            "decode attention: Triton split-KV, or FlashAttention-4",
            choices=("auto", "triton", "fa4"), notes=(("auto", "Triton where it runs"),),
            field="decode_kernel",
        ),
        EnvVar(
            "KVPLAN_DECODE_BALANCE", SWITCH, True,
            "the Triton decode kernel balances its splits over a large batch's long and short sequences",
            field="decode_balanced",
        ),
        EnvVar(
            "KVPLAN_DECODE_FINE_SPLITS", SWITCH, True,
            "the Triton decode kernel splits pages of more than 64 tokens into 64-token units (block 256 "
            "single stream 0.919 → 0.765 ms/token); whole pages with `0`, as the block-256 profiles were "
            "recorded",
            field="decode_fine_splits",
        ),
        EnvVar(
            "KVPLAN_LAYER_IMPL", CHOICE, "auto", "norms, rotary, SiLU kernels",
            choices=("auto", "triton", "compile", "torch"),
            notes=(("auto", "Triton on CUDA, `compile` without Triton, `torch` on CPU"),),
            field="layer_kernels",
        ),
        EnvVar(
            "KVPLAN_PREFILL_GRAPHS", SWITCH, True,
            "piecewise CUDA graphs for prefill and mixed steps (`LLM(prefill_graphs=...)` wins)",
            field="prefill_graphs",
        ),
        EnvVar(
            "KVPLAN_STEP_GRAPHS", SWITCH, True,
            "prefill and mixed steps of at most 2,048 tokens replay as one CUDA graph each, attention "
            "included, where the backend allows (FlashAttention-4); piecewise with `0`",
            field="step_graphs",
        ),
        EnvVar(
            "KVPLAN_PDL", SWITCH, True,
            "programmatic dependent launch of the Triton kernels (sm_90+, ≤ 16 rows)",
            field="pdl",
        ),
        EnvVar(
            "KVPLAN_GEMV_PREFETCH", SWITCH, True,
            "the one-row GEMV reads its weights before waiting on the kernel before it (needs PDL)",
            field="gemv_prefetch",
        ),
        EnvVar(
            "KVPLAN_TRITON_ARGMAX", SWITCH, True,
            "the sampler's argmax in Triton (CUDA), no float copy of an all-greedy batch's logits; torch's "
            "argmax with `0` (with the next row: single stream 0.851 → 0.830 ms/token, docs/PERF.md)",
            field="triton_argmax",
        ),
        EnvVar(
            "KVPLAN_GRAPH_COPY", SWITCH, True,
            "one Triton launch copies a decode step's inputs into the CUDA graph's buffers; torch's copies "
            "with `0`",
            field="graph_copy_kernel",
        ),
        EnvVar(
            "KVPLAN_GEMV_TUNED_TILES", SWITCH, True,
            "one-row GEMVs of Qwen3-0.6B's shapes take the tiles tuned inside the decode graph "
            "(`benchmarks/tune_decode_tiles.py`); the general rule with `0`",
            field="gemv_tuned_tiles",
        ),
        EnvVar(
            "KVPLAN_HEAD_ARGMAX", SWITCH, True,
            "a one-row all-greedy step computes the LM head and its argmax in one pass, without writing "
            "the logits (CUDA, TP 1); cuBLAS and the sampler with `0`",
            field="fused_head_argmax",
        ),
        EnvVar(
            "KVPLAN_TABLE_ROWS", SWITCH, True,
            "a step's block table is gathered from rows the host keeps per sequence and extends by the "
            "blocks each step adds (under TP each worker too, sent only those blocks); rebuilt from every "
            "sequence's list each step with `0`",
            field="table_rows",
        ),
        EnvVar(
            "KVPLAN_DEVICE_TABLES", SWITCH, True,
            "with kept table rows, a copy of them stays on the device: a step sends it only its rows' "
            "indices and the entries written since the step before, and its table is gathered there "
            "(the host's work no longer grows with the table's width); the host gathers the table and "
            "copies it whole with `0`",
            field="device_tables",
        ),
        EnvVar(
            "KVPLAN_FREEZE_GC", SWITCH, True,
            "what start-up built is moved out of Python's garbage collector's reach (as vLLM does), so "
            "a full collection no longer walks it in the middle of a step (a 0.4 s pause without); "
            "`LLM(freeze_gc=...)` wins",
        ),
        EnvVar(
            "KVPLAN_TP_PORT", PORT, None,
            "the rendezvous port of the tensor-parallel ranks (`LLM(dist_port=...)` wins)",
            notes=(("unset", "a free port"),),
        ),
        EnvVar(
            "KVPLAN_TP_TEST_EXIT", RANK_STEP, None,
            "tests only: that tensor-parallel worker exits at that step",
            public=False,
        ),
    )
}  # fmt: skip
_BY_FIELD = {v.field: v for v in VARIABLES.values() if v.field is not None}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the registered variable `name` in `environ` (default: os.environ): its default
    when unset or empty, else the parsed value; ValueError naming the variable and what it allows."""
    var = VARIABLES.get(name)
    if var is None:
        raise KeyError(f"{name} is not an engine setting registered in engine/envs.py")
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    return var.default if not raw else var.parse(raw)


def _default(field: str) -> Any:
    return _BY_FIELD[field].default


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel runs where the engine has a choice; each field is set by one variable of
    `VARIABLES` (its `field`). As asked for (`from_env`, or built with explicit values): a kernel
    name or "auto", a switch True / False. As resolved for one engine
    (`engine.model_runner.resolve_kernels`): what runs there; a switch is False where its kernel
    cannot run (no CUDA, no Triton, tensor parallelism), and a field is None where the choice does
    not arise (the decode fields of a backend with a single decode kernel)."""

    decode_kernel: str | None = _default("decode_kernel")
    decode_balanced: bool | None = _default("decode_balanced")
    decode_fine_splits: bool | None = _default("decode_fine_splits")
    layer_kernels: str | None = _default("layer_kernels")
    prefill_graphs: bool | None = _default("prefill_graphs")
    step_graphs: bool | None = _default("step_graphs")
    pdl: bool | None = _default("pdl")
    gemv_prefetch: bool | None = _default("gemv_prefetch")
    triton_argmax: bool | None = _default("triton_argmax")
    graph_copy_kernel: bool | None = _default("graph_copy_kernel")
    gemv_tuned_tiles: bool | None = _default("gemv_tuned_tiles")
    fused_head_argmax: bool | None = _default("fused_head_argmax")
    table_rows: bool | None = _default("table_rows")
    device_tables: bool | None = _default("device_tables")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, var = getattr(self, f.name), _BY_FIELD[f.name]
            if value is None:
                continue
            if var.kind == SWITCH and not isinstance(value, bool):
                raise ValueError(f"{f.name}: {value!r} is not True or False ({var.name}: 0 or 1)")
            if var.kind == CHOICE and value not in var.choices:
                raise ValueError(f"{f.name}: {value!r} is not one of {list(var.choices)} ({var.name})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **explicit: Any) -> KernelConfig:
        """What `environ` (default: os.environ) asks for, each variable through `get`; an explicit
        keyword that is not None (an engine's constructor argument) wins over its variable."""
        unknown = set(explicit) - set(_BY_FIELD)
        if unknown:
            raise TypeError(f"KernelConfig.from_env: no kernel choice {sorted(unknown)}")
        values = {
            field: explicit[field] if explicit.get(field) is not None else get(var.name, environ)
            for field, var in _BY_FIELD.items()
        }
        return cls(**values)

    def record(self) -> dict[str, Any]:
        """The fields as step records, replays and profiles store them (`LLM.kernel_choices`):
        `prefill_graphs` as "piecewise" / "eager", every other field as it is."""
        out = dataclasses.asdict(self)
        if self.prefill_graphs is not None:
            out["prefill_graphs"] = "piecewise" if self.prefill_graphs else "eager"
        return out

    def activate(self) -> _Active:
        """`with config.activate():` kernels launched inside read their call-time switches from this
        config (`current`); the model runner wraps its start-up and its steps in it."""
        return _Active(self)


_ACTIVE: ContextVar[KernelConfig | None] = ContextVar("kvplan_kernel_config", default=None)


class _Active:
    __slots__ = ("config", "token")

    def __init__(self, config: KernelConfig) -> None:
        self.config = config

    def __enter__(self) -> KernelConfig:
        self.token = _ACTIVE.set(self.config)
        return self.config

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self.token)


def current(field: str) -> Any:
    """The kernel choice `field` of the engine launching kernels now (`KernelConfig.activate`);
    outside one, what the environment asks for, read now."""
    config = _ACTIVE.get()
    if config is not None:
        return getattr(config, field)
    return get(_BY_FIELD[field].name)


def markdown_table() -> str:
    """The README's table of engine settings: the public variables, in registry order."""
    rows = [
        "| variable | values (default first) | recorded as | what it switches |",
        "| --- | --- | --- | --- |",
    ]
    for var in VARIABLES.values():
        if var.public:
            recorded = f"`{var.field}`" if var.field else "—"
            rows.append(f"| `{var.name}` | {var.values_markdown()} | {recorded} | {var.doc} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.envs", description="The engine's environment settings."
    )
    parser.add_argument("--markdown", action="store_true", help="print the README's table of settings")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return 0
    for var in VARIABLES.values():
        raw = os.environ.get(var.name, "").strip()
        print(f"{var.name}={get(var.name)!r}" + ("" if raw else " (default)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
