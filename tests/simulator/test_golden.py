"""One seeded simulation whose summary is compared with a committed golden file.

Regenerate (after an intended behaviour change) with KVPLAN_UPDATE_GOLDEN=1 pytest tests/simulator.
"""

import json
import math
import os
from pathlib import Path

from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation

GOLDEN = Path(__file__).parent / "golden_summary.json"
KEYS = (
    "num_requests",
    "num_finished",
    "num_rejected",
    "num_preemptions",
    "prefix_hit_rate",
    "duration_s",
    "throughput_rps",
    "output_tok_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "tpot_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "kv_usage_max",
    "sim_steps",
)


def test_golden_summary(prefix_trace, small_config):
    cfg = small_config(num_kv_blocks=150, num_replicas=2, router="prefix_aware", policy="chunked")
    summary = run_simulation(prefix_trace, cfg, latency=RooflineModel(cfg.model, "H200")).summary
    got = {k: summary[k] for k in KEYS}
    if os.environ.get("KVPLAN_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert set(want) == set(got)
    for k in KEYS:
        if isinstance(want[k], float):
            assert math.isclose(got[k], want[k], rel_tol=1e-9), (k, got[k], want[k])
        else:
            assert got[k] == want[k], (k, got[k], want[k])
