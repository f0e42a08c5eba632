"""Generators: seeded determinism, arrival and length statistics, shared prefixes and multi-turn sessions."""

import numpy as np
import pandas as pd
import pytest

import traces
from traces import generate


def cv(times: np.ndarray) -> float:
    g = np.diff(times)
    return float(g.std() / g.mean())


# ----------------------------------------------------------------- arrivals


def test_poisson_rate_and_cv():
    t = traces.poisson_arrivals(20.0, rng=1, n=100_000)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all() and len(t) == 100_000
    assert 1 / np.diff(t).mean() == pytest.approx(20.0, rel=0.02)
    assert cv(t) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("target", [0.5, 2.0, 4.0])
def test_gamma_cv(target):
    t = traces.gamma_arrivals(10.0, target, rng=7, n=200_000)
    assert cv(t) == pytest.approx(target, rel=0.05)
    assert 1 / np.diff(t).mean() == pytest.approx(10.0, rel=0.05)


def test_constant_and_duration():
    t = traces.constant_arrivals(4.0, duration_s=10.0)
    assert len(t) == 40 and t[-1] == pytest.approx(9.75)
    assert traces.gamma_arrivals(4.0, 0.0, rng=0, n=5).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    d = traces.poisson_arrivals(50.0, rng=3, duration_s=100.0)
    assert d[-1] < 100.0 and len(d) == pytest.approx(5000, rel=0.05)
    both = traces.poisson_arrivals(50.0, rng=3, n=10, duration_s=100.0)
    assert len(both) == 10


def test_onoff():
    t = traces.onoff_arrivals(40.0, 5.0, 15.0, rng=2, duration_s=2000.0)
    phase = t % 20.0
    assert (phase < 5.0).all()
    assert len(t) / 2000.0 == pytest.approx(10.0, rel=0.05)  # 40/s a quarter of the time
    t2 = traces.onoff_arrivals(40.0, 5.0, 15.0, rng=2, rate_off=4.0, duration_s=2000.0)
    off = t2[(t2 % 20.0) >= 5.0]
    assert len(off) / (100 * 15.0) == pytest.approx(4.0, rel=0.1)
    assert len(traces.onoff_arrivals(40.0, 5.0, 15.0, rng=2, n=123)) == 123


def test_arrival_spec_errors():
    with pytest.raises(ValueError, match="rate must be a positive number"):
        traces.poisson_arrivals(0, rng=0, n=3)
    with pytest.raises(ValueError, match="arrival kind must be one of"):
        traces.sample_arrivals("weibull", rng=0, n=3)
    with pytest.raises(ValueError, match=r"missing field 'cv'"):
        traces.sample_arrivals({"kind": "gamma", "rate": 1}, rng=0, n=3)
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        traces.poisson_arrivals(1.0, rng=None, n=3)


# ----------------------------------------------------------------- lengths


def test_fixed_uniform():
    assert traces.sample_lengths(7, 3, rng=0).tolist() == [7, 7, 7]
    u = traces.uniform_lengths(50_000, 10, 20, rng=0)
    assert u.min() == 10 and u.max() == 20 and u.mean() == pytest.approx(15, rel=0.01)


def test_lognormal_mean_sigma_and_percentiles():
    x = traces.lognormal_lengths(200_000, rng=0, mean=1000, sigma=0.8)
    assert x.mean() == pytest.approx(1000, rel=0.02)
    y = traces.lognormal_lengths(200_000, rng=0, p50=800, p90=3000)
    p50, p90 = np.percentile(y, [50, 90])
    assert p50 == pytest.approx(800, rel=0.02) and p90 == pytest.approx(3000, rel=0.02)
    z = traces.lognormal_lengths(10_000, rng=0, mean=100, sigma=2.0, min=5, max=300)
    assert z.min() >= 5 and z.max() <= 300
    with pytest.raises(ValueError, match="mean and sigma, or p50 and p90"):
        traces.lognormal_lengths(3, rng=0, mean=5)


def test_empirical_resamples_a_trace():
    src = traces.load_shipped("azure_conv_2023")
    x = traces.sample_lengths({"kind": "empirical", "trace": src}, 5000, rng=0)
    assert set(x.tolist()) <= set(src.df["prompt_len"].tolist())
    assert x.mean() == pytest.approx(src.df["prompt_len"].mean(), rel=0.05)
    y = traces.sample_lengths("empirical:azure_conv_2023", 10, rng=0, column="output_len")
    assert set(y.tolist()) <= set(src.df["output_len"].tolist())


def test_parse_length_spec():
    assert traces.parse_length_spec("512") == 512
    assert traces.parse_length_spec("uniform:100:2000") == {"kind": "uniform", "low": 100, "high": 2000}
    assert traces.parse_length_spec("lognormal:p50=800,p90=3000") == {
        "kind": "lognormal",
        "p50": 800.0,
        "p90": 3000.0,
    }
    assert traces.parse_length_spec("lognormal:mean=1000,sigma=0.8,max=4096") == {
        "kind": "lognormal",
        "mean": 1000.0,
        "sigma": 0.8,
        "max": 4096,
    }
    assert traces.parse_length_spec("empirical:x.csv#prompt_len") == {
        "kind": "empirical",
        "trace": "x.csv",
        "column": "prompt_len",
    }
    with pytest.raises(ValueError, match="cannot parse length spec"):
        traces.parse_length_spec("normal:1")


# ----------------------------------------------------------------- generate


def test_generate_is_seeded_and_deterministic():
    spec = {"rate": 5, "num_requests": 500, "prompt": "lognormal:p50=500,p90=2000", "output": "uniform:1:300"}
    a, b = generate(spec, seed=3), generate(spec, seed=3)
    pd.testing.assert_frame_equal(a.df, b.df)
    c = generate(spec, seed=4)
    assert not a.df["arrival_s"].equals(c.df["arrival_s"])
    # arrivals do not depend on the length distributions (independent streams)
    d = generate({**spec, "output": 64}, seed=3)
    assert d.df["arrival_s"].tolist() == a.df["arrival_s"].tolist()
    assert a.df["request_id"].tolist() == list(range(500))
    assert not a.has_prefix_ids


def test_generate_kwargs_and_duration():
    t = generate(arrival="gamma", rate=20, cv=3, duration_s=60, prompt=100, output=10, name="burst")
    assert t.name == "burst" and t.df["arrival_s"].max() < 60
    assert len(t) == pytest.approx(1200, rel=0.35)
    with pytest.raises(ValueError, match="unknown key"):
        generate(rate=1, num_requests=3, burst=2)
    with pytest.raises(ValueError, match="num_requests and/or duration_s"):
        generate(rate=1)


def test_shared_prefix_zipf_and_exact_sharing():
    t = generate(
        rate=10,
        num_requests=3000,
        prompt=100,
        output=10,
        shared_prefix={"num_prefixes": 5, "prefix_len": 1024, "zipf": 1.2},
        seed=1,
    )
    assert t.prefix_block_size == 512
    first = np.array([t.prefix_ids(i)[0] for i in range(len(t))])
    counts = pd.Series(first).value_counts()
    # prefixes start at ids 0, 2, 4, 6, 8; popularity decreases with rank
    assert sorted(counts.index.tolist()) == [0, 2, 4, 6, 8]
    assert counts[0] > counts[2] > counts[4] > counts[8]
    p = traces.zipf_probabilities(5, 1.2)
    assert counts[0] / len(t) == pytest.approx(p[0], abs=0.03)
    same = [i for i in range(1, 50) if first[i] == first[0]][:3]
    a = np.array(t.token_ids(0))
    for j in same:
        b = np.array(t.token_ids(j))
        assert (a[:1024] == b[:1024]).all() and not (a[1024:] == b[1024:]).all()
    other = next(i for i in range(len(t)) if first[i] != first[0])
    assert not (a[:512] == np.array(t.token_ids(other))[:512]).all()
    assert (t.df["prompt_len"] == 1124).all()


def test_shared_prefix_block_size_and_fraction():
    t = generate(
        rate=10,
        num_requests=400,
        prompt=10,
        shared_prefix={"num_prefixes": 2, "prefix_len": 1000, "fraction": 0.5},
    )
    assert t.prefix_block_size == 8  # gcd(512, 1000)
    with_prefix = (t.df["prompt_len"] == 1010).mean()
    assert with_prefix == pytest.approx(0.5, abs=0.1)
    with pytest.raises(ValueError, match="not a multiple of prefix_block_size 64"):
        generate(rate=1, num_requests=3, prefix_block_size=64, shared_prefix={"prefix_len": 1000})


def test_sessions_extend_previous_turns():
    t = generate(
        rate=2,
        num_requests=400,
        prompt=300,
        output="uniform:10:100",
        sessions={"turns": 4, "think_time_s": 5.0},
        shared_prefix={"num_prefixes": 2, "prefix_len": 512},
        seed=5,
    )
    assert len(t) == 400 and t.has_sessions
    df = t.df
    for _sid, g in list(df.groupby("session_id"))[:20]:
        rows = g.index.tolist()
        assert (np.diff(g["arrival_s"]) > 0).all()
        for r0, r1 in zip(rows, rows[1:]):
            # turn n = turn n-1 prompt + its output + 300 new tokens
            assert df.at[r1, "prompt_len"] == df.at[r0, "prompt_len"] + df.at[r0, "output_len"] + 300
            ids0, ids1 = t.prefix_ids(r0), t.prefix_ids(r1)
            assert ids1[: len(ids0)].tolist() == ids0.tolist() and len(ids1) >= len(ids0)
            a, b = t.token_ids(r0), t.token_ids(r1)
            assert b[: len(a)] == a
    assert (df.groupby("session_id").size() <= 4).all()
    s = traces.trace_stats(t)
    assert s.sessions == df["session_id"].nunique()


def test_sessions_without_shared_prefix_count_exact():
    t = generate(rate=1, num_requests=50, prompt=40, output=20, sessions={"turns": "uniform:1:5"}, seed=0)
    assert len(t) == 50 and t.prefix_block_size == 512
    assert t.df["session_id"].min() == 0
