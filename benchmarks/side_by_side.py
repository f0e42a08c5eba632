"""kvplan's engine and nano-vllm side by side on one GPU: each workload on each system in a process of
its own, one after the other, on one random-weight checkpoint; tok/s of each and the ratio.

    PYTHONPATH=. python3 benchmarks/side_by_side.py --out $OUT --peers .devkit/peers
    PYTHONPATH=. python3 benchmarks/side_by_side.py --out /tmp/sbs --small --systems ours   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = ("nano_recipe", "long_context")
EPILOG = """\
Workloads (BENCHMARKS.md): nano_recipe (256 requests from random.seed(0); ours through
bench_throughput.py at block 256, async scheduling on) and long_context (bench_long_context.py's
window; ours at block 256, async on). nano-vllm runs through nano_vllm_peer.py with
PYTHONPATH=<peers>/nano-vllm:<peers>/fa2_shim. Flags this script does not know go to both systems'
long-context runs (e.g. --window 0:150 --warmup request; --block-size 16 changes ours only).
Writes <system>_<workload>.log and .json (ours' long-context run: a folder) and side_by_side.json."""
SYSTEMS = ("ours", "nano")
# --small: a tiny model on the CPU (vocabulary over 10,000: the recipe's token ids), short workloads
SMALL_RECIPE = ["--num-seqs", "3"]
SMALL_LONG = ["--small"]

_PREPARE = """
import sys
sys.path.insert(0, sys.argv[1])
from side_by_side import prepare_models
prepare_models(*sys.argv[2:])
"""


# --------------------------------------------------------------------------- models


def prepare_models(root: str, preset: str, vocab_size: str, with_tokenizer: str) -> None:
    """(In a subprocess, so that this one never holds the GPU.) A random checkpoint of `preset` in
    root/model; with a tokenizer, root/model_tok: the same files linked, plus a WordLevel tokenizer of
    the model's vocabulary (nano-vllm loads one from the model folder)."""
    import torch

    from engine.checkpoint import make_random_checkpoint

    cuda = torch.cuda.is_available()
    overrides = {"vocab_size": int(vocab_size)} if int(vocab_size) else {}
    model = make_random_checkpoint(
        Path(root) / "model", "qwen3", preset, seed=0, dtype="bfloat16" if cuda else "float32",
        device="cuda" if cuda else "cpu", **overrides,
    )  # fmt: skip
    if with_tokenizer == "1":
        write_tokenizer_copy(model, Path(root) / "model_tok")


def write_tokenizer_copy(model: Path, out: Path) -> Path:
    """`out`: links to `model`'s files and a WordLevel tokenizer of its vocabulary size."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "config.json").read_text())
    vocab = {f"t{i}": i for i in range(int(config["vocab_size"]))}
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
        unk_token="t0",
        eos_token=f"t{eos if eos is not None else 1}",
    )
    tok.save_pretrained(str(out))
    return out


def make_models(args: argparse.Namespace, work: Path) -> tuple[Path, Path | None]:
    """(our model folder, nano-vllm's folder with a tokenizer or None): --model-dir, or made now."""
    need_tok = "nano" in args.systems
    if args.model_dir:
        model = Path(args.model_dir)
        return model, (write_tokenizer_copy(model, work / "model_tok") if need_tok else None)
    vocab = "10240" if args.small else "0"  # tiny preset: room for the recipe's token ids
    preset = "tiny" if args.small else args.preset
    cmd = [sys.executable, "-c", _PREPARE, str(HERE), str(work), preset, vocab, "1" if need_tok else "0"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=child_env(None), cwd=ROOT)
    print(f"random {preset} checkpoint in {time.perf_counter() - t:.1f} s: {work / 'model'}", flush=True)
    return work / "model", (work / "model_tok" if need_tok else None)


# --------------------------------------------------------------------------- children


def child_env(peers: Path | None) -> dict[str, str]:
    """The environment of a child: the repository (and nano-vllm with its FA2 shim when `peers`)
    ahead of the inherited PYTHONPATH; unbuffered output."""
    paths = [str(peers / "nano-vllm"), str(peers / "fa2_shim")] if peers else []
    paths += [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def cuda_available() -> bool:
    """Asked in a subprocess: this process never touches the GPU."""
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], env=child_env(None)).returncode == 0


def child_command(
    system: str, workload: str, model: Path, json_path: Path, args, extra: list[str]
) -> list[str]:
    """The command line of one (system, workload) run."""
    py = sys.executable
    if system == "ours" and workload == "nano_recipe":
        cmd = [py, str(HERE / "bench_throughput.py"), "--model-dir", str(model), "--block-size", "256",
               "--async-scheduling", "on", "--json", str(json_path),
               "--records", str(json_path.with_name(json_path.stem + "_steps.parquet"))]  # fmt: skip
        return cmd + (SMALL_RECIPE if args.small else [])
    long_flags = (SMALL_LONG if args.small else []) + extra
    if system == "ours":
        out = json_path.with_suffix("")
        return [py, str(HERE / "bench_long_context.py"), "--model-dir", str(model), "--block-size", "256",
                "--async-scheduling", "on", "--out", str(out), *long_flags]  # fmt: skip
    cmd = [py, str(HERE / "nano_vllm_peer.py"), "--workload", workload, "--model-dir", str(model),
           "--json", str(json_path)]  # fmt: skip
    return cmd + (SMALL_RECIPE if args.small and workload == "nano_recipe" else long_flags)


def run_child(
    name: str, cmd: list[str], env: dict[str, str], log: Path, timeout_s: float
) -> tuple[int, float]:
    """Run `cmd`, its output streamed with a `[name]` prefix and kept in `log`; (exit code, seconds).
    A run still going after `timeout_s` is killed (exit code -9)."""
    print(f"[{name}] $ {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                print(f"[{name}] {line}", end="", flush=True)
            rc = proc.wait()
        finally:
            watchdog.cancel()
    if rc == -9:
        print(f"[{name}] killed after {timeout_s:.0f} s", flush=True)
    return rc, time.perf_counter() - t


def read_result(system: str, workload: str, json_path: Path) -> dict | None:
    """The child's summary: tok/s, wall and start-up seconds (None if it wrote none)."""
    path = (
        json_path.with_suffix("") / "long_context.json"
        if (system, workload) == ("ours", "long_context")
        else json_path
    )
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if (system, workload) == ("ours", "nano_recipe"):
        run = data["runs"][0]
        return {"tok_per_s": run["tok_per_s"], "wall_s": run["wall_s"], "start_s": data["start_s"]}
    keep = ("tok_per_s", "wall_s", "start_s", "prefix_hit_rate", "floor")
    return {k: data[k] for k in keep if k in data}


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for logs and JSON results")
    ap.add_argument(
        "--peers",
        default=".devkit/peers",
        help="folder holding nano-vllm/ and fa2_shim/ (default: %(default)s)",
    )
    ap.add_argument(
        "--systems", default="ours,nano", help="comma-separated: ours, nano (default: %(default)s)"
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--model-dir", help="checkpoint folder (default: random --preset weights in a temp dir)")
    ap.add_argument("--preset", default="qwen3-0.6b", help="random-weight preset (default: %(default)s)")
    ap.add_argument(
        "--child-timeout-s", type=float, default=300, help="kill a run after this (default: %(default)s)"
    )
    ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny model, a few requests")
    args, extra = ap.parse_known_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for name, got, allowed in (("systems", args.systems, SYSTEMS), ("workloads", args.workloads, WORKLOADS)):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            ap.error(f"--{name}: {bad or got} not in {list(allowed)}")
    return args, extra


def check_nano(args: argparse.Namespace) -> Path | None:
    """The peers folder when nano-vllm is to run, or SystemExit saying why it cannot."""
    if "nano" not in args.systems:
        return None
    peers = Path(args.peers).resolve()
    if not (peers / "nano-vllm" / "nanovllm").is_dir() or not (peers / "fa2_shim").is_dir():
        raise SystemExit(f"--peers {args.peers}: no nano-vllm/nanovllm or fa2_shim/ there "
                         "(cp -r /work/shared/peers .devkit/peers before the call)")  # fmt: skip
    if not cuda_available():
        raise SystemExit("nano-vllm needs a CUDA GPU and this machine has none: run with --systems ours")
    return peers


def print_table(results: dict[tuple[str, str], dict | None], args: argparse.Namespace) -> None:
    """One row per workload: each system's tok/s (wall and start-up seconds), the ratio."""

    def cell(key: tuple[str, str]) -> str:
        r = results.get(key)
        if r is None:
            return "failed" if key in results else "-"
        return f"{r['tok_per_s']:,.0f} ({r['wall_s']:.1f} s, start {r['start_s']:.0f} s)"

    print(f"\n{'workload':>13}  {'kvplan tok/s':>30}  {'nano-vllm tok/s':>30}  {'ratio':>6}")
    for w in args.workloads:
        ours, nano = results.get(("ours", w)), results.get(("nano", w))
        ratio = f"{ours['tok_per_s'] / nano['tok_per_s']:.2f}x" if ours and nano else "-"
        print(f"{w:>13}  {cell(('ours', w)):>30}  {cell(('nano', w)):>30}  {ratio:>6}")
    long = results.get(("ours", "long_context"))
    if long and long.get("floor"):
        f = long["floor"]
        print(f"kvplan long_context: {f['fraction_of_floor']:.2f} of its per-step floor "
              f"({f['per_step_floor_s']:.1f} s: compute {f['compute_floor_s']:.1f} s, bandwidth "
              f"{f['bandwidth_floor_s']:.1f} s), prefix hit rate {long['prefix_hit_rate']:.1%}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peers = check_nano(args)
    work = Path(tempfile.mkdtemp(prefix="kvplan_sbs_"))
    results: dict[tuple[str, str], dict | None] = {}
    runs = []
    try:
        model, model_tok = make_models(args, work)
        for workload in args.workloads:
            for system in args.systems:  # ours first, then nano-vllm, on each workload
                name = f"{system}_{workload}"
                json_path = out / f"{name}.json"
                folder = model_tok if system == "nano" else model
                cmd = child_command(system, workload, folder, json_path, args, extra)
                env = child_env(peers if system == "nano" else None)
                rc, secs = run_child(name, cmd, env, out / f"{name}.log", args.child_timeout_s)
                results[(system, workload)] = read_result(system, workload, json_path) if rc == 0 else None
                runs.append({"system": system, "workload": workload, "rc": rc, "seconds": round(secs, 1),
                             "command": cmd, "result": results[(system, workload)]})  # fmt: skip
                print(f"[{name}] exit {rc} after {secs:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "side_by_side.json").write_text(json.dumps({"extra_flags": extra, "runs": runs}, indent=2) + "\n")
    print_table(results, args)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
