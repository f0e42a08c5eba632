"""kvplan traces: the canonical request Trace, loaders for public traces, generators, transforms, stats.

Everything here is CPU-only pandas/numpy/pyarrow (no torch). Typical use:
`traces.load("azure_conv.csv")`, `traces.generate(rate=5, num_requests=1000)`, `traces.trace_stats(t)`.
"""

from .generators import (
    constant_arrivals,
    empirical_lengths,
    fixed_lengths,
    gamma_arrivals,
    generate,
    lognormal_lengths,
    onoff_arrivals,
    parse_length_spec,
    poisson_arrivals,
    sample_arrivals,
    sample_lengths,
    uniform_lengths,
    zipf_probabilities,
)
from .loaders import (
    FORMATS,
    TraceWarning,
    detect_format,
    load,
    load_shipped,
    save,
    shipped,
    shipped_names,
)
from .schema import (
    SCHEMA_DOC,
    LoadReport,
    Trace,
    TraceError,
    splitmix64,
    synthetic_token_ids,
    synthetic_vocab_size,
)
from .stats import LengthStats, PrefixReuse, TraceStats, length_stats, prefix_reuse, trace_stats
from .transforms import CapReport, cap_lengths, concat, scale_rate, subsample, time_window

__all__ = [
    "FORMATS",
    "SCHEMA_DOC",
    "CapReport",
    "LengthStats",
    "LoadReport",
    "PrefixReuse",
    "Trace",
    "TraceError",
    "TraceStats",
    "TraceWarning",
    "cap_lengths",
    "concat",
    "constant_arrivals",
    "detect_format",
    "empirical_lengths",
    "fixed_lengths",
    "gamma_arrivals",
    "generate",
    "length_stats",
    "load",
    "load_shipped",
    "lognormal_lengths",
    "onoff_arrivals",
    "parse_length_spec",
    "poisson_arrivals",
    "prefix_reuse",
    "sample_arrivals",
    "sample_lengths",
    "save",
    "scale_rate",
    "shipped",
    "shipped_names",
    "splitmix64",
    "subsample",
    "synthetic_token_ids",
    "synthetic_vocab_size",
    "time_window",
    "trace_stats",
    "uniform_lengths",
    "zipf_probabilities",
]
