"""README's examples are checked, so they stay true."""
from pathlib import Path



from icl_bench.config import parse_config, tomllib

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_readme_config_example_is_a_valid_matrix():
    block = README.split("## Matrix config (TOML)")[1].split("```toml")[1].split("```")[0]
    cfg = parse_config(tomllib.loads(block))
    assert cfg.grid["N"] == [10, 30, 100, 300] and cfg.solvers["gd-lsa"] == [{"steps": 1}, {"steps": 4}, {"steps": 16}]


def test_readme_setup_commands_match_ci_script():
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    setup = 'pip install torch==2.13.0 && pip install -e ".[dev]" && icl-bench run'
    assert setup in README and setup in ci
    assert "python -m pytest" in README and "\npython -m pytest" in ci
