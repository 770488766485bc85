"""The package layout (docs/design.md §2): small modules, no import cycle, every import pointing
down the pipeline, and no test reaching into the registry's private state."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "icl_bench"
MAX_LINES = 400
# stage of each top-level part of the package: a module may import only from its own stage or a
# lower one (foundation modules are stage 0; cli is the top)
STAGES = {"errors": 0, "files": 0, "provenance": 0, "config_base": 0, "resources": 0, "startup": 0,
          "prompts": 1, "solvers": 2, "bench": 3, "analysis": 4, "training": 5, "report": 6,
          "cli": 7, "cli_models": 7, "cli_run": 7, "__main__": 7, "__init__": 7}
SIBLINGS_APART = {("bench", "training"), ("training", "bench")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every icl_bench module `path` imports, at any depth (function-local imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`
            names = [n for n in subs if n in mods] or [node.module]
            names += [node.module] if len(names) < len(subs) and node.module not in names else []
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n.startswith("icl_bench"):
                out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(p, mods) - {m} for m, p in mods.items()}


def stage(mod: str) -> tuple[str, int]:
    part = mod.split(".")[1] if mod.count(".") else "__init__"
    return part, STAGES[part]


def test_every_module_has_a_stage():
    unknown = sorted({m.split(".")[1] for m in modules() if m.count(".")} - set(STAGES))
    assert not unknown, f"add these parts of the package to STAGES and docs/design.md §2: {unknown}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(g.get(m, ())):
            if n.startswith("icl_bench.") and n in g and n != "icl_bench":
                if state.get(n) == 1:
                    pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]) if n in path else n)
                if n not in state:
                    visit(n, path + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])


def test_imports_point_down_the_pipeline():
    bad = []
    for m, deps in graph().items():
        if m == "icl_bench":
            continue
        part, level = stage(m)
        for d in deps:
            if d == "icl_bench":
                bad.append(f"{m} imports the package root (import from the module that defines the name)")
                continue
            dpart, dlevel = stage(d)
            if dlevel > level or (part, dpart) in SIBLINGS_APART:
                bad.append(f"{m} (stage {part}) imports {d} (stage {dpart})")
    assert not bad, "\n".join(sorted(bad))


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path):
    # control: the two checks above must fire on a known positive
    fake = {"icl_bench.prompts.a": {"icl_bench.solvers.b"}, "icl_bench.solvers.b": {"icl_bench.prompts.a"}}
    ups = [(m, d) for m, deps in fake.items() for d in deps if stage(d)[1] > stage(m)[1]]
    assert ups == [("icl_bench.prompts.a", "icl_bench.solvers.b")]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from icl_bench.report.publish import publish\n")
    assert imports_of(src, modules()) == {"icl_bench.report.publish"}


def test_tests_use_the_registry_api_not_its_private_state():
    pattern = re.compile(r"(registry|REGISTRY)\._\w+|\b_registered\b|\b_origins?\b\[|\b_broken\b")
    hits = [f"{p.name}:{i}" for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_code_cites_in_repo_docs_only():
    pattern = re.compile(r"shared/|DESIGN\.md|DESIGN section|\b[Ii]ssue \d+")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in ("icl_bench", "icl_bench_baselines", "tests", "benchmarks")
            for p in (ROOT / base).rglob("*.py") if p.name != Path(__file__).name
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
    cited = {m.group(1) for base in ("icl_bench", "icl_bench_baselines") for p in (ROOT / base).rglob("*.py")
             for m in re.finditer(r"\b(docs/[\w.-]+\.md)", p.read_text())}
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"code cites docs that do not exist: {missing}"


def test_the_readme_layout_names_every_module():
    """README.md's "Layout" lists the package's modules; six had gone missing from it, two of
    them cited by the docs and by error messages (a new-user tryout)."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    files = sorted(p.relative_to(PKG) for p in PKG.rglob("*.py") if p.name != "__init__.py")
    missing = [str(f) for f in files if not re.search(rf"(?<![\w.]){re.escape(f.name)}", layout)]
    assert not missing, f"README.md's Layout does not name: {missing}"
