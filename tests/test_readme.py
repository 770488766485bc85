"""README's examples are checked, so they stay true."""
import re
from pathlib import Path



from icl_bench.bench.config import parse_config
from icl_bench.config_base import tomllib

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_config_example_is_a_valid_matrix():
    block = README.split("## Matrix config (TOML)")[1].split("```toml")[1].split("```")[0]
    cfg = parse_config(tomllib.loads(block))
    assert cfg.grid["N"] == [10, 30, 100, 300] and cfg.solvers["gd-lsa"] == [{"steps": 1}, {"steps": 4}, {"steps": 16}]


def test_readme_setup_commands_match_ci_script():
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    setup = 'pip install torch==2.13.0 && pip install -e ".[dev]" && icl-bench run'
    assert setup in README and setup in ci
    assert "python -m pytest" in README and "\npython -m pytest" in ci


def test_readme_headline_is_the_published_table():
    from icl_bench.report.docblock import read_block

    published = (Path(__file__).parents[1] / "results" / "default" / "headline.md").read_text().strip()
    assert read_block(Path(__file__).parents[1] / "README.md", "headline") == published


def test_docblock_replaces_only_the_marked_text(tmp_path):
    import pytest

    from icl_bench.report.docblock import read_block, replace_block
    from icl_bench.errors import ConfigError

    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- t:begin (note) -->\nold\n<!-- t:end -->\noutro\n")
    replace_block(doc, "t", "new table")
    assert doc.read_text() == "intro\n<!-- t:begin (note) -->\nnew table\n<!-- t:end -->\noutro\n"
    assert read_block(doc, "t") == "new table"
    with pytest.raises(ConfigError, match="no block marked <!-- other:begin -->"):
        replace_block(doc, "other", "x")


def test_docblock_markers_count_only_alone_on_their_line(tmp_path):
    """A README whose prose quoted the markers (as docs/report.md does) got the table pasted into
    that sentence, and a second block stayed stale without a word (found by a review)."""
    import pytest

    from icl_bench.errors import ConfigError
    from icl_bench.report.docblock import replace_block

    prose = "The table sits between the `<!-- t:begin -->` / `<!-- t:end -->` markers.\n"
    doc = tmp_path / "doc.md"
    doc.write_bytes(f"{prose}\n  <!-- t:begin (note) -->\nold\n<!-- t:end -->  \nend\r".encode())
    replace_block(doc, "t", "new")
    assert doc.read_bytes() == f"{prose}\n  <!-- t:begin (note) -->\nnew\n<!-- t:end -->  \nend\r".encode()
    doc.write_text(prose)
    with pytest.raises(ConfigError, match="no block marked .* on a line of its own"):
        replace_block(doc, "t", "new")
    doc.write_text("<!-- t:begin -->\na\n<!-- t:end -->\n\n<!-- t:begin -->\nb\n<!-- t:end -->\n")
    with pytest.raises(ConfigError, match="has 2 lines <!-- t:begin -->, the second at line 5; keep one"):
        replace_block(doc, "t", "new")
    assert doc.read_text() == "<!-- t:begin -->\na\n<!-- t:end -->\n\n<!-- t:begin -->\nb\n<!-- t:end -->\n"
    # a mistyped end marker: everything up to the next block's end was replaced, prose included (a review)
    typo = "<!-- t:begin -->\nold A\n<!-- t:end-->\n\n## Prose\n\nKeep me.\n\n<!-- t:begin -->\nold B\n<!-- t:end -->\n"
    doc.write_text(typo)
    with pytest.raises(ConfigError, match="has 2 lines <!-- t:begin -->"):
        replace_block(doc, "t", "new")
    assert doc.read_text() == typo
    # markers shown in a fenced example do not count (they were a second block, or the only one)
    fence = "```markdown\n<!-- t:begin -->\n<!-- t:end -->\n```\n"
    doc.write_text(f"{fence}\n<!-- t:begin -->\nold\n<!-- t:end -->\n")
    replace_block(doc, "t", "new")
    assert doc.read_text() == f"{fence}\n<!-- t:begin -->\nnew\n<!-- t:end -->\n"
    doc.write_text(fence)
    with pytest.raises(ConfigError, match="no block marked .* outside fenced code"):
        replace_block(doc, "t", "new")
    doc.write_bytes("\ufeff<!-- t:begin -->\nold\n<!-- t:end -->\n".encode())  # a BOM before the first marker
    replace_block(doc, "t", "new")
    assert doc.read_bytes() == "\ufeff<!-- t:begin -->\nnew\n<!-- t:end -->\n".encode()


def test_docblock_keeps_every_byte_outside_the_block_and_the_files_line_endings(tmp_path, monkeypatch):
    """publish --readme rewrote a CRLF file with LF everywhere (read_text / write_text translate
    newlines) and wrote it in place; now only the block changes, in the file's own line endings,
    through an atomic replace that keeps the file's mode and a link to it."""
    import os

    import pytest

    from icl_bench.report import docblock

    head, tail = "x\r\n<!-- headline:begin (note) -->", "<!-- headline:end -->\r\ntail \n mixed\r\n"
    real = tmp_path / "real.md"
    real.write_bytes(f"{head}\r\nold\r\n{tail}".encode())
    os.chmod(real, 0o640)
    doc = tmp_path / "r.md"
    doc.symlink_to(real)
    docblock.replace_block(doc, "headline", "| a |\n|---|\n| 1 |\n")
    assert real.read_bytes() == f"{head}\r\n| a |\r\n|---|\r\n| 1 |\r\n{tail}".encode()
    assert doc.is_symlink() and (real.stat().st_mode & 0o777) == 0o640
    assert docblock.read_block(doc, "headline") == "| a |\n|---|\n| 1 |"
    lf = tmp_path / "lf.md"
    lf.write_bytes(b"a\n<!-- t:begin -->\nold\n<!-- t:end -->\n")
    docblock.replace_block(lf, "t", "new\r\ntable")
    assert lf.read_bytes() == b"a\n<!-- t:begin -->\nnew\ntable\n<!-- t:end -->\n"

    def torn(path, data, **kw):  # a crash mid-write: the old file must stay whole
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(docblock, "write_atomic", torn)
    before = real.read_bytes()
    with pytest.raises(OSError):
        docblock.replace_block(doc, "headline", "other")
    assert real.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["lf.md", "r.md", "real.md"]


def test_readme_python_api_snippet_runs():
    block = README.split("## Python API")[1].split("```python")[1].split("```")[0]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert abs(float(scope["mine"].ols_prediction[0]) - 2.0) < 1e-12
    assert float(((scope["pred"] - scope["batch"].ols_prediction) ** 2).mean()) < 1e-5
    assert len(scope["table"]) == 2 * 3 and (scope["table"].status == "ok").all()


def test_model_card_and_training_doc_agree_with_the_shipped_checkpoints():
    """docs/training.md said "Six of the nine checkpoints record ... -dirty" when twelve shipped,
    nine of them dirty. The commits now live in the generated model card's commit column, and the
    doc states no count that could go stale."""
    import json
    import re

    from benchmarks.experiments.checkpoint_table import short_commit
    from icl_bench.resources import models_dir

    card = (models_dir() / "README.md").read_text()
    for path in sorted(models_dir().glob("*.json")):
        commit = short_commit(json.loads(path.read_text()).get("git_commit"))
        assert re.search(rf"^\| {re.escape(path.stem)} \|.*\| {re.escape(commit)} \|$", card, re.M), path.stem
    doc = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert not re.search(r"\b(\w+) of the (\w+) (shipped )?checkpoints record", doc, re.I)


def test_readme_command_table_names_every_option_of_every_command():
    """Each row of the README's command table names every option its command accepts (analyze's
    --n-prompts, --seed, --N and train's --no-progress were missing: a new-user tryout)."""
    from icl_bench.cli import build_parser

    text = (ROOT / "README.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `icl-bench (\w+)[^\n]*", text, re.M)}
    commands = build_parser()._subparsers._group_actions[0].choices  # name -> its parser
    missing = {}
    for name, parser in commands.items():
        if name == "report":  # the alias of publish
            continue
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        lost = sorted(o for o in options if not re.search(rf"{re.escape(o)}(?![\w-])", rows.get(name, "")))
        if lost:
            missing[name] = lost
    assert set(rows) >= set(commands) - {"report"} and not missing, (sorted(rows), missing)
    assert all(parser.description for parser in commands.values())  # `icl-bench list --help` said nothing of it
