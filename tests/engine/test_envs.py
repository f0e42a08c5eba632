"""The registry of environment settings (engine/envs.py): parsing, defaults and errors; the kernel
config read from it once, resolved for a device and recorded by `LLM.kernel_choices`; the README's
table generated from it; and no other module reading a KVPLAN_* variable from os.environ."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import CPU_ENGINE, ROOT, make_prompts

from engine import envs
from engine.attention.fa4 import FlashAttnCuteBackend
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.envs import VARIABLES, KernelConfig
from engine.layers import gemv, pdl
from engine.model_runner import resolve_kernels
from engine.sampling_params import SamplingParams

SWITCH_FIELDS = [v.field for v in VARIABLES.values() if v.kind == envs.SWITCH and v.field]


def test_every_kernel_variable_sets_one_field():
    fields = [f.name for f in dataclasses.fields(KernelConfig)]
    set_by = [v.field for v in VARIABLES.values() if v.field is not None]
    assert sorted(set_by) == sorted(fields)  # each field one variable, each variable's field exists
    assert all(v.name.startswith("KVPLAN_") for v in VARIABLES.values())
    assert KernelConfig() == KernelConfig.from_env({})  # the defaults are the registry's
    assert KernelConfig().decode_kernel == "auto" and KernelConfig().pdl is True


def test_get_parses_and_defaults():
    assert envs.get("KVPLAN_PDL", {}) is True
    assert envs.get("KVPLAN_PDL", {"KVPLAN_PDL": "0"}) is False
    assert envs.get("KVPLAN_PDL", {"KVPLAN_PDL": " 1 "}) is True
    assert envs.get("KVPLAN_PDL", {"KVPLAN_PDL": ""}) is True  # empty is unset
    assert envs.get("KVPLAN_DECODE_KERNEL", {"KVPLAN_DECODE_KERNEL": "fa4"}) == "fa4"
    assert envs.get("KVPLAN_TP_PORT", {}) is None
    assert envs.get("KVPLAN_TP_PORT", {"KVPLAN_TP_PORT": "29517"}) == 29517
    assert envs.get("KVPLAN_TP_PORT", {"KVPLAN_TP_PORT": "0"}) == 0
    assert envs.get("KVPLAN_TP_TEST_EXIT", {"KVPLAN_TP_TEST_EXIT": "1:3"}) == (1, 3)
    with pytest.raises(KeyError, match="KVPLAN_NOPE is not an engine setting"):
        envs.get("KVPLAN_NOPE", {})


def test_get_reads_os_environ(monkeypatch):
    monkeypatch.setenv("KVPLAN_GRAPH_COPY", "0")
    assert envs.get("KVPLAN_GRAPH_COPY") is False
    monkeypatch.delenv("KVPLAN_GRAPH_COPY")
    assert envs.get("KVPLAN_GRAPH_COPY") is True


BAD = {
    "KVPLAN_PDL": ("on", "KVPLAN_PDL: 'on' is not 0 or 1"),
    "KVPLAN_DECODE_KERNEL": ("cuda", "KVPLAN_DECODE_KERNEL: 'cuda' is not one of ['auto', 'triton', 'fa4']"),
    "KVPLAN_LAYER_IMPL": ("fast", "KVPLAN_LAYER_IMPL: 'fast' is not one of ['auto', 'triton', 'compile', 'torch']"),
    "KVPLAN_TP_PORT": ("70000", "KVPLAN_TP_PORT: '70000' is not a port number (0 to 65535)"),
    "KVPLAN_TP_TEST_EXIT": ("1-3", "KVPLAN_TP_TEST_EXIT: '1-3' is not RANK:STEP (two integers)"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_a_bad_value_names_the_variable_and_what_it_allows(name):
    var = VARIABLES[name]
    raw, message = BAD.get(name, ("yes", f"{name}: 'yes' is not 0 or 1"))
    with pytest.raises(ValueError) as err:
        envs.get(name, {name: raw})
    assert str(err.value) == message and var.allowed() in message
    for text in ("-1", "a:b", "1:2:3", "TRUE"):
        with pytest.raises(ValueError, match=name):
            envs.get(name, {name: text})


def test_from_env_explicit_arguments_win():
    environ = {"KVPLAN_PREFILL_GRAPHS": "0", "KVPLAN_DECODE_KERNEL": "fa4", "KVPLAN_HEAD_ARGMAX": "0"}
    asked = KernelConfig.from_env(environ)
    assert (asked.prefill_graphs, asked.decode_kernel, asked.fused_head_argmax) == (False, "fa4", False)
    assert asked.pdl is True  # unset: the default
    assert KernelConfig.from_env(environ, prefill_graphs=True).prefill_graphs is True
    assert KernelConfig.from_env(environ, prefill_graphs=None).prefill_graphs is False  # None: the env's
    with pytest.raises(TypeError, match="no kernel choice"):
        KernelConfig.from_env(environ, decode_kernels="fa4")
    with pytest.raises(ValueError, match="KVPLAN_HEAD_ARGMAX: 'x' is not 0 or 1"):
        KernelConfig.from_env({"KVPLAN_HEAD_ARGMAX": "x"})


def test_kernel_config_checks_its_values():
    with pytest.raises(ValueError, match=r"decode_kernel: 'cuda' is not one of \['auto', 'triton', 'fa4'\]"):
        KernelConfig(decode_kernel="cuda")
    with pytest.raises(ValueError, match=r"pdl: 1 is not True or False \(KVPLAN_PDL: 0 or 1\)"):
        KernelConfig(pdl=1)
    assert KernelConfig(decode_kernel=None, decode_balanced=None).decode_kernel is None  # resolved: no choice
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelConfig().pdl = False


def test_record_keeps_the_recorded_values():
    record = KernelConfig(prefill_graphs=False, decode_kernel=None).record()
    assert record["prefill_graphs"] == "eager" and record["decode_kernel"] is None
    assert KernelConfig().record()["prefill_graphs"] == "piecewise"
    assert list(record) == [f.name for f in dataclasses.fields(KernelConfig)]


def test_current_reads_the_active_config_else_the_environment(monkeypatch):
    monkeypatch.setenv("KVPLAN_GEMV_TUNED_TILES", "0")
    assert envs.current("gemv_tuned_tiles") is False
    assert gemv.block_sizes(1, 6144, 1024, gemv.PROLOGUE_NORM) == (2, 1024, 2)  # the rule
    with KernelConfig(gemv_tuned_tiles=True).activate() as active:
        assert active.gemv_tuned_tiles and envs.current("gemv_tuned_tiles") is True
        assert gemv.block_sizes(1, 6144, 1024, gemv.PROLOGUE_NORM) == (8, 1024, 2)  # tuned
        with KernelConfig(gemv_tuned_tiles=False).activate():
            assert envs.current("gemv_tuned_tiles") is False
        assert envs.current("gemv_tuned_tiles") is True
    assert envs.current("gemv_tuned_tiles") is False
    monkeypatch.setenv("KVPLAN_GEMV_TUNED_TILES", "maybe")
    with KernelConfig().activate():  # inside an engine the environment is not read again
        assert envs.current("gemv_tuned_tiles") is True
    with pytest.raises(ValueError, match="KVPLAN_GEMV_TUNED_TILES"):
        envs.current("gemv_tuned_tiles")


def test_pdl_follows_the_active_config(monkeypatch):
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("KVPLAN_PDL", "1")
    cuda = torch.device("cuda", 0)
    with KernelConfig(pdl=False).activate():
        assert pdl.launch_kwargs(cuda, 1) == {"USE_PDL": False}
    assert pdl.launch_kwargs(cuda, 1) == {"USE_PDL": True, "launch_pdl": True}
    assert not pdl.enabled(cuda, switch=False)


def _fa4(kernels: KernelConfig) -> FlashAttnCuteBackend:
    return FlashAttnCuteBackend(
        varlen_fn=lambda *a, **k: None, decode_fn=lambda *a, **k: None, kernels=kernels
    )


def test_resolve_on_a_cpu():
    asked = KernelConfig()
    got = resolve_kernels(asked, TorchSDPABackend(), torch.device("cpu"), 1, use_graphs=False)
    assert got == KernelConfig(
        decode_kernel=None, decode_balanced=None, decode_fine_splits=None, layer_kernels="torch",
        table_rows=True,  # the host's block tables: no kernel, so on a CPU too
        device_tables=True,  # and their copy on the model's device
        **{
            field: False
            for field in SWITCH_FIELDS
            if field not in ("decode_balanced", "decode_fine_splits", "table_rows", "device_tables")
        },
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernels(
            KernelConfig(layer_kernels="triton"), TorchSDPABackend(), torch.device("cpu"), 1, False
        )


@pytest.mark.parametrize("field", SWITCH_FIELDS)
def test_resolve_on_a_cuda_device_follows_each_switch(monkeypatch, field):
    """Each switch's variable, 0 and 1, reaches what runs on a (stand-in) capable GPU."""
    pytest.importorskip("triton")
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    name = next(v.name for v in VARIABLES.values() if v.field == field)
    for value in (False, True):
        asked = KernelConfig.from_env({name: str(int(value))})
        got = resolve_kernels(asked, _fa4(asked), cuda, 1, use_graphs=True)
        everything_on = KernelConfig(decode_kernel="triton", layer_kernels="triton")
        expected = dataclasses.replace(everything_on, **{field: value})
        if field == "prefill_graphs":  # whole-step graphs are captured beside the piecewise ones
            expected = dataclasses.replace(expected, step_graphs=value)
        if field == "table_rows":  # their device copy is of kept rows
            expected = dataclasses.replace(expected, device_tables=value)
        assert got == expected, (name, value)


def test_resolve_turns_off_what_cannot_run(monkeypatch):
    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    cuda, asked = torch.device("cuda", 0), KernelConfig(decode_kernel="fa4")
    got = resolve_kernels(asked, _fa4(asked), cuda, 2, use_graphs=False)
    assert got.decode_kernel == "fa4" and got.decode_balanced is None and got.decode_fine_splits is None
    assert got.fused_head_argmax is False  # tensor parallel: no fused head
    assert got.prefill_graphs is False  # no decode graphs (enforce_eager): no piecewise ones
    assert got.step_graphs is False
    assert got.table_rows is True  # a host thing: TP workers keep their tables too
    assert got.device_tables is True
    assert (
        resolve_kernels(asked, TorchSDPABackend(), cuda, 1, True).step_graphs is False
    )  # not step-graph safe
    assert resolve_kernels(asked, TorchSDPABackend(), cuda, 1, True).decode_kernel is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels(asked, TorchSDPABackend(), cuda, 1, True).pdl is False


def test_engine_reads_the_environment_once_and_records_its_config(checkpoints, monkeypatch):
    """A CPU engine: a bad value fails at start, naming the variable; once started, its steps run
    under the config it read (a value set later is not read); kernel_choices is that config's
    record plus async scheduling."""
    from engine.llm import LLM

    monkeypatch.setenv("KVPLAN_HEAD_ARGMAX", "on")
    with pytest.raises(ValueError, match="KVPLAN_HEAD_ARGMAX: 'on' is not 0 or 1"):
        LLM(checkpoints["qwen3"], **CPU_ENGINE)
    monkeypatch.delenv("KVPLAN_HEAD_ARGMAX")
    seen = []
    with LLM(checkpoints["qwen3"], **CPU_ENGINE) as llm:
        sample = llm.runner._sample

        def spy(hidden, inputs):
            seen.append((envs.current("pdl"), envs.current("gemv_tuned_tiles")))
            return sample(hidden, inputs)

        llm.runner._sample = spy
        monkeypatch.setenv("KVPLAN_PDL", "bad")
        monkeypatch.setenv("KVPLAN_GEMV_TUNED_TILES", "bad")
        llm.generate(make_prompts()[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert seen and set(seen) == {(False, False)}  # the CPU engine's resolved config
        choices = llm.kernel_choices()
        assert choices == {**llm.kernels.record(), "async_scheduling": False}
        assert set(choices) == {f.name for f in dataclasses.fields(KernelConfig)} | {"async_scheduling"}
        assert llm.kernels.layer_kernels == llm.runner.layer_impl == "torch"


# ---- the README's table ------------------------------------------------------------------------


def _readme_table() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variable | values (default first)"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def test_readme_table_is_the_registry():
    assert _readme_table() == envs.markdown_table(), "regenerate it: python -m engine.envs --markdown"
    table = envs.markdown_table()
    assert all(f"`{v.name}`" in table for v in VARIABLES.values() if v.public)
    assert "KVPLAN_TP_TEST_EXIT" not in table  # tests only


def test_markdown_command():
    done = subprocess.run(
        [sys.executable, "-m", "engine.envs", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == envs.markdown_table() + "\n"


# ---- nobody else reads the environment ---------------------------------------------------------

SCANNED = ("engine", "simulator", "traces", "benchmarks", "dashboard")
# The dashboard's own settings (KVPLAN_DASHBOARD_*, KVPLAN_VALIDATION_DIR), still read where they are
# used: to move into the registry. The test fails once either file stops reading them.
NOT_YET = {"dashboard/state.py", "dashboard/app_pages/validation.py"}
_READ_METHODS = {"get", "pop"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _reads_environ(func: ast.AST) -> bool:
    """os.environ.get / .pop, environ.get, os.getenv, getenv."""
    if isinstance(func, ast.Attribute):
        return (func.attr in _READ_METHODS and _is_environ(func.value)) or func.attr == "getenv"
    return isinstance(func, ast.Name) and func.id == "getenv"


def env_reads(source: str) -> list[str]:
    """Where `source` reads os.environ (`.get`, `.pop`, `[...]`, `in`, os.getenv) with a KVPLAN_*
    key (a literal, an f-string starting with one, or a module constant bound to one) or with a key
    that is no literal (a reader of its own): "line: key" each."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and isinstance(node.value.value, str)
    }
    keys: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _reads_environ(node.func):
            keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)  # `key in os.environ`
    found = []
    for key in keys:
        if isinstance(key, ast.Name) and key.id in constants:
            value = constants[key.id]
        elif isinstance(key, ast.Constant) and isinstance(key.value, str):
            value = key.value
        elif isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
            value = str(key.values[0].value) + "{...}"
        else:
            value = None  # a key computed at run time
        if value is None or value.startswith("KVPLAN_"):
            found.append(f"{key.lineno}: {ast.unparse(key)}")
    return found


def test_the_scan_finds_reads():
    source = """
import os
from os import environ, getenv
PORT = "KVPLAN_PORT"
OTHER = "HOME"
a = os.environ.get("KVPLAN_A")
b = os.environ["KVPLAN_B"]
c = "KVPLAN_C" in os.environ
d = os.getenv(PORT)
e = environ.get(f"KVPLAN_{a}")
def switch(name):
    return getenv(name)
fine = os.environ.get("TRITON_INTERPRET"), os.environ.get(OTHER), dict(os.environ)
os.environ.setdefault("NCCL_X", "0")
env = {**os.environ, "KVPLAN_SET_FOR_A_CHILD": "1"}
"""
    assert env_reads(source) == [
        "6: 'KVPLAN_A'", "7: 'KVPLAN_B'", "8: 'KVPLAN_C'", "9: PORT", "10: f'KVPLAN_{a}'", "12: name",
    ]  # fmt: skip


def test_no_module_but_envs_reads_a_kvplan_variable():
    readers = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "engine/envs.py":
                continue
            reads = env_reads(path.read_text())
            if reads:
                readers[rel] = reads
    assert set(readers) == NOT_YET, readers
    assert env_reads(Path(envs.__file__).read_text())  # the scan sees the registry's own read
