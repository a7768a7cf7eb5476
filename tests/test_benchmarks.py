"""The benchmark tools are a package: each runs as ``python -m benchmarks.<tool> --help`` from the
repository root (CPU is enough for ``--help``), and the tools never import the experiments."""

import ast
import pathlib
import subprocess
import sys

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
