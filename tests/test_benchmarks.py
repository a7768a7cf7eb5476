"""The benchmark tools are a package: each runs as ``python -m benchmarks.<tool> --help`` from the
repository root (CPU is enough for ``--help``), and the tools never import the experiments."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TOOLS = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py"))
EXPERIMENTS = sorted(p.stem for p in (BENCHMARKS / "experiments").glob("*.py")
                     if p.stem != "__init__")

# One interpreter for all modules (torch is imported once): each runs as __main__ with --help.
_HELP_ALL = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        assert exc.code == 0, (name, exc.code)
    assert "usage:" in out.getvalue(), name
    print("ok", name)
"""


def test_every_tool_and_experiment_answers_help_as_a_module():
    modules = [f"benchmarks.{t}" for t in TOOLS] + [f"benchmarks.experiments.{e}"
                                                    for e in EXPERIMENTS]
    assert "benchmarks.bench_attention" in modules and len(EXPERIMENTS) >= 1
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split().count("ok") == len(modules)


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_tools_do_not_import_experiments_or_edit_sys_path():
    for path in BENCHMARKS.glob("*.py"):
        assert not any("experiments" in name for name in _imports(path)), path.name
        assert "sys.path" not in path.read_text(), path.name


# What an experiment may import of the library: the packages' public names, nothing deeper.
PUBLIC_PACKAGES = {"mini_paged_attn", "mini_paged_attn.ops", "mini_paged_attn.engine"}


def _import_faults(path: pathlib.Path) -> list[str]:
    faults = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            faults += [f"import {a.name}" for a in node.names
                       if a.name.startswith("mini_paged_attn") and a.name not in PUBLIC_PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if node.module.startswith("mini_paged_attn") and node.module not in PUBLIC_PACKAGES:
                faults.append(f"from {node.module}")
            if node.module.startswith("benchmarks.experiments.") or (
                    node.module == "benchmarks" and "experiments" not in names
                    and any(n not in TOOLS and n != "common" for n in names)):
                faults.append(f"from {node.module} (another experiment)")
            if node.module.split(".")[0] in ("mini_paged_attn", "benchmarks"):
                faults += [f"from {node.module} import {n}" for n in names if n.startswith("_")]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A kernel body of its own is a copy of the library's, which drifts from it.
            faults += [f"kernel {node.name}" for d in node.decorator_list
                       if "jit" in ast.unparse(d)]
    return faults


def test_experiments_use_public_interfaces_only():
    faults = {p.name: f for p in sorted((BENCHMARKS / "experiments").glob("*.py"))
              if (f := _import_faults(p))}
    assert not faults, faults


def test_experiments_readme_lists_every_experiment():
    readme = (BENCHMARKS / "experiments" / "README.md").read_text()
    listed = {line.split("`")[1].removesuffix(".py") for line in readme.splitlines()
              if line.startswith("| `")}
    assert listed == set(EXPERIMENTS)
    for name in EXPERIMENTS:
        assert f"python -m benchmarks.experiments.{name}" in readme, name


# Two trees in one process, as prefill_ab runs them: this checkout and a copy of it under two
# names, each with modules of its own, on a small CPU batch (the torch reference).
_TWO_TREES = """
import sys, torch
from benchmarks import bench_prefill
from benchmarks.experiments import import_tree
from benchmarks.experiments.prefill_ab import tree_calls
bench_prefill.DEVICE = "cpu"
root, copy = sys.argv[1:]
a, b = import_tree(root, "mpa_tree_a"), import_tree(copy, "mpa_tree_b")
assert a.ops.paged_prefill is not b.ops.paged_prefill
assert b.ops.paged_prefill.__module__.startswith("mpa_tree_b."), b.ops.paged_prefill.__module__
assert b.ops.__file__.startswith(copy), b.ops.__file__
assert import_tree(root, "mpa_tree_a") is a
case = bench_prefill.Case("small", (5, 3), (4, 0), head_size=16)
batch = bench_prefill.paged_batch(case, block_size=4)
contiguous = bench_prefill.contiguous_kv(batch)
outs = {}
for name, package in (("a", a), ("b", b)):
    for layout, (call, result) in tree_calls(package.ops, batch, contiguous).items():
        call()
        outs[name, layout] = result().float()
for layout in ("paged", "contiguous"):
    assert torch.equal(outs["a", layout], outs["b", layout]), layout
torch.testing.assert_close(outs["a", "paged"], outs["a", "contiguous"], atol=2e-2, rtol=2e-2)
print("ok")
"""

# engine_ab's worker: the tree imported as mini_paged_attn itself, before anything else, so
# the tools' lazy imports find that tree's engine.
_AS_THE_LIBRARY = """
import sys

import pytest
from benchmarks.experiments import import_tree
import_tree(sys.argv[1], "mini_paged_attn")
from benchmarks.bench_engine import engine_options
from mini_paged_attn.engine import LLM
assert sys.modules[LLM.__module__].__file__.startswith(sys.argv[1]), LLM.__module__
assert engine_options(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
print("ok")
"""


def _copy_of_the_package(tmp_path: pathlib.Path) -> pathlib.Path:
    import shutil
    shutil.copytree(ROOT / "mini_paged_attn", tmp_path / "tree" / "mini_paged_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return (tmp_path / "tree").resolve()


def test_import_tree_runs_two_checkouts_side_by_side(tmp_path):
    copy = _copy_of_the_package(tmp_path)
    for script in (_TWO_TREES, _AS_THE_LIBRARY):
        args = [str(ROOT), str(copy)] if script is _TWO_TREES else [str(copy)]
        done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, check=False,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["ok"]


def test_import_tree_refuses_a_directory_without_the_package_or_a_taken_name(tmp_path):
    from benchmarks.experiments import import_tree
    with pytest.raises(ValueError, match="tree: expected a checkout"):
        import_tree(tmp_path, "mpa_nothing_here")
    (tmp_path / "mini_paged_attn").mkdir()
    (tmp_path / "mini_paged_attn" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match="name: 'pathlib' is already imported"):
        import_tree(tmp_path, "pathlib")
    with pytest.raises(ValueError, match="name: expected a Python identifier"):
        import_tree(tmp_path, "not a name")


def test_the_cascade_workloads_share_exactly_their_system_prompt():
    from benchmarks.engine_cascade import (OWN_TOKENS, SYSTEM_TOKENS, cascade_requests,
                                           report_lines)
    system, shared, _ = cascade_requests(6, shared=True)
    _, alone, params = cascade_requests(6, shared=False)
    assert all(p[:SYSTEM_TOKENS] == system for p in shared)
    assert len({tuple(p[:16]) for p in alone}) == 6           # no two share a first block
    for prompts in (shared, alone):
        assert all(OWN_TOKENS[0] <= len(p) - SYSTEM_TOKENS <= OWN_TOKENS[1] for p in prompts)
    assert params.ignore_eos
    run = {"seconds": 1.0, "tok_per_s": 130.0, "steps": 300, "cascade_steps": 250}
    line, = report_lines({"cascade": {"requests": 6, "on": run, "ratio": 1.3,
                                      "off": {**run, "tok_per_s": 100.0, "cascade_steps": 0}}})
    assert "250/300 cascade steps" in line and "1.30x" in line
