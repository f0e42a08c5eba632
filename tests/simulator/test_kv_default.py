"""The default KV cache of a simulation is the engine's sizing of the GPU's memory, never a profile's.

Every shipped GPU (simulator/data/gpus.json) x model preset (simulator/data/models/) at blocks 16 and
256: the count `SimConfig` gets without `num_kv_blocks` equals `engine.memory.default_num_kv_blocks`
on the GPU's measured (else datasheet) memory, and both equal the pinned value.
"""

import pytest

import traces
from engine.memory import default_num_kv_blocks, kv_cache_bytes
from simulator.config import SimConfig, kv_blocks_per_replica
from simulator.defaults import SHIPPED_PROFILE_DIR
from simulator.latency.gpus import get_gpu, load_gpu_specs
from simulator.models import resolve_model
from simulator.run import run_simulation

# (gpu, model) -> blocks per GPU at (block 16 tp 1, block 16 tp 2, block 256 tp 1), engine defaults:
# gpu_memory_utilization 0.9, max_num_batched_tokens 16384, max_num_seqs 256.
EXPECTED = {
    ("H100-SXM", "llama-3-8b"): (27416, 63387, 1713),
    ("H100-SXM", "qwen3-0.6b"): (40652, 82174, 2540),
    ("H100-SXM", "qwen3-8b"): (24327, 56280, 1520),
    ("H200-SXM", "llama-3-8b"): (54972, 118499, 3435),
    ("H200-SXM", "qwen3-0.6b"): (72145, 145160, 4509),
    ("H200-SXM", "qwen3-8b"): (48821, 105269, 3051),
    ("A100-80GB-SXM", "llama-3-8b"): (27416, 63387, 1713),
    ("A100-80GB-SXM", "qwen3-0.6b"): (40652, 82174, 2540),
    ("A100-80GB-SXM", "qwen3-8b"): (24327, 56280, 1520),
    ("B200", "llama-3-8b"): (73496, 155547, 4593),
    ("B200", "qwen3-0.6b"): (93315, 187500, 5832),
    ("B200", "qwen3-8b"): (65287, 138200, 4080),
    ("L40S", "llama-3-8b"): (12670, 33896, 791),
    ("L40S", "qwen3-0.6b"): (23800, 48470, 1487),
    ("L40S", "qwen3-8b"): (11220, 30066, 701),
}
PRESETS = sorted(p.stem for p in (SHIPPED_PROFILE_DIR.parent / "data" / "models").glob("*.json"))


def test_every_shipped_gpu_and_preset_is_pinned():
    assert set(EXPECTED) == {(g, m) for g in load_gpu_specs() for m in PRESETS}


@pytest.mark.parametrize(("gpu", "model"), sorted(EXPECTED))
def test_default_kv_blocks_are_the_engines_sizing_of_the_gpu(gpu, model):
    spec, memory = resolve_model(model), get_gpu(gpu).usable_memory_bytes
    got, engine = [], []
    for block, tp in ((16, 1), (16, 2), (256, 1)):
        got.append(
            kv_blocks_per_replica(SimConfig(model=spec, gpu=gpu, block_size=block, tensor_parallel_size=tp))
        )
        engine.append(default_num_kv_blocks(spec, block, memory, tp=tp))
    assert tuple(got) == tuple(engine) == EXPECTED[(gpu, model)]


def test_the_h200_default_by_hand(qwen06):
    """Qwen3-0.6B on an H200, block 16: every term of the engine's budget in integers."""
    usable = 135_098_892_288  # 150_109_880_320 measured bytes x 0.9
    weights = 1_192_099_840  # param_bytes: 596_049_920 bf16 parameters
    activation = 491_126_784  # 16384 tokens x (4 x 1024 + 2 x 3072) x 2 B + 256 rows x 151936 x 4 B
    graphs = 512 << 20  # the decode graphs' pool
    budget = usable - weights - activation - graphs - activation  # - activation: prefill graphs' pool
    assert budget == 132_387_667_968
    assert kv_cache_bytes(150_109_880_320, 0.9, weights, activation) == budget
    assert budget // (16 * 114_688) == 72_145  # 1_154_320 tokens
    assert kv_blocks_per_replica(SimConfig(model=qwen06)) == 72_145


def test_kv_blocks_per_replica_takes_the_given_memory_and_the_config_count(qwen06):
    cfg = SimConfig(model=qwen06, gpu="H200", gpu_memory_utilization=0.5, max_num_batched_tokens=8192)
    assert (
        kv_blocks_per_replica(cfg, 80 * 2**30)
        == default_num_kv_blocks(
            qwen06, 16, 80 * 2**30, gpu_memory_utilization=0.5, max_num_batched_tokens=8192
        )
        == 22_111
    )  # (42_949_672_960 - 1_192_099_840 - 2 x 323_354_624 - 536_870_912) // 1_835_008
    assert kv_blocks_per_replica(SimConfig(model=qwen06, num_kv_blocks=123)) == 123


@pytest.mark.parametrize(
    ("profile", "blocks", "calibrated"),
    [
        ("qwen3-0.6b_h200_tp1_bs16.json", 72_145, 71_455),
        ("qwen3-0.6b_h200_tp1_bs256.json", 4_509, 4_466),
        ("qwen3-8b_h200_tp1_bs16.json", 48_821, 48_691),
    ],
)
def test_a_profiles_calibration_cache_is_recorded_not_used(profile, blocks, calibrated):
    model = profile.split("_")[0]
    block = int(profile.removesuffix(".json").split("_bs")[1])
    cfg = SimConfig(model=resolve_model(model), gpu="H200", block_size=block)
    trace = traces.generate(num_requests=4, seed=0)
    s = run_simulation(trace, cfg, profile=SHIPPED_PROFILE_DIR / profile).summary
    assert s["num_kv_blocks_per_replica"] == blocks
    assert s["kv_blocks_source"] == "gpu_memory"
    assert (s["latency_model"], s["profile"], s["profile_num_kv_blocks"]) == ("fitted", profile, calibrated)


def test_num_kv_blocks_still_overrides(qwen06):
    cfg = SimConfig(model=qwen06, num_kv_blocks=8192)
    s = run_simulation(traces.generate(num_requests=4, seed=0), cfg).summary
    assert (s["num_kv_blocks_per_replica"], s["kv_blocks_source"]) == (8192, "config")
    assert (s["latency_model"], s["profile"], s["profile_num_kv_blocks"]) == ("roofline", None, None)


def test_simulate_header_names_the_cache_source_and_the_latency_model(capsys):
    from simulator.cli import main

    assert main(["simulate", "--limit", "5", "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "config: Qwen3-0.6B on 1 x H200 (tp=1), block 16, 72,145 KV blocks/replica (GPU memory), "
        "max_num_seqs 256, max_num_batched_tokens 16384, chunked, router round_robin"
    )
    assert lines[2] == (
        "latency: fitted profile qwen3-0.6b_h200_tp1_bs16.json (calibrated on a cache of 71,455 KV blocks, "
        "whole-step graphs)"
    )
    assert main(["simulate", "--limit", "5", "--quiet", "--block-size", "256"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        "latency: fitted profile qwen3-0.6b_h200_tp1_bs256.json (calibrated on a cache of 4,466 KV blocks, "
        "whole-step graphs)"
    )
    assert main(["simulate", "--limit", "5", "--quiet", "--block-size", "256", "--model", "qwen3-8b"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        "latency: fitted profile qwen3-8b_h200_tp1_bs256.json (calibrated on a cache of 3,043 KV blocks, "
        "whole-step graphs)"
    )
    assert (
        main(["simulate", "--limit", "5", "--quiet", "--num-kv-blocks", "8192", "--profile", "roofline"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "block 16, 8,192 KV blocks/replica (--num-kv-blocks), " in lines[1]
    assert lines[2] == "latency: roofline"
