"""Edge cases of the report (publish, outdir, mechanism, docblock, run_summary, coverage,
plot_gaps) and of the bench (executors, hostload, timing, metrics, cells, contract) that a
mutation review found untested: each test fails when its one-line change is applied."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from icl_bench.report import mechanism
from icl_bench.report.aggregate import add_series

# the default generator: E[(a + b u)^2] = 2, so relative error = mse_vs_ols / 2
CELL = {"N": 20, "noise": 0.1, "R": 100.0, "dtype": "float64", "device": "cpu", "d": 1, "prompts": "{}",
        "seed": 0, "status": "ok"}


def ood_rows(*specs) -> pd.DataFrame:
    """Result rows from (solver, {ood: relative error}, cell overrides) tuples."""
    out = [{**CELL, **where, "solver": solver, "solver_params": "{}", "ood": ood, "mse_vs_ols": 2 * e}
           for solver, rel, where in specs for ood, e in rel.items()]
    return add_series(pd.DataFrame(out))


def verdicts(frame: pd.DataFrame) -> pd.DataFrame:
    return mechanism.section(frame)["table"].set_index("series")


def test_one_nan_answer_on_a_well_posed_prompt_fails_its_ood_cell():
    """A cell whose MSE is over all but one well-posed prompt (the solver answered NaN on one)
    is no measurement of invariance: it fails, as with 31 NaN answers."""
    base = {"none": 1e-6, "x_shift=1": 1e-6, "x_scale=2": 1e-6}
    frame = ood_rows(("ols", base, {}), ("one-nan", base, {}))
    frame["n_nonfinite_well_posed"] = 0
    frame.loc[(frame.solver == "one-nan") & (frame.ood == "x_shift=1"), "n_nonfinite_well_posed"] = 1
    got = verdicts(frame)
    assert got.loc["ols", "verdict"] == "closed-form-like"
    assert got.loc["one-nan", "verdict"] == "neither" and got.loc["one-nan", "unmeasured_cells"] == 1
    assert "x_shift=1: no error measured" in got.loc["one-nan", "why"]


def test_scales_below_the_judged_range_are_shown_not_judged():
    """Only scales 0.1 <= S <= 10 are judged (docs: the success criterion's range); x × 0.01 is
    shown in the table but cannot turn an invariant solver into "neither"."""
    frame = ood_rows(("s", {"none": 1e-6, "x_shift=5": 1e-6, "x_scale=10": 1e-6, "x_scale=0.01": 0.5}, {}))
    got = verdicts(frame).loc["s"]
    assert got["verdict"] == "closed-form-like", got["why"]
    assert got["x_scale=0.01"] == pytest.approx(0.5)
    frame = ood_rows(("s", {"none": 1e-6, "x_shift=5": 1e-6, "x_scale=0.1": 0.5}, {}))
    assert verdicts(frame).loc["s", "verdict"] == "neither"  # the lower end itself is judged


def test_an_error_far_above_the_unmapped_one_is_not_invariant_though_both_are_off():
    """"Inaccurate in distribution too" excuses a map's error only when it is at most twice the
    unmapped one (the same inaccuracy): 50 times the unmapped error is the map's doing."""
    far = verdicts(ood_rows(("far", {"none": 0.02, "x_shift=5": 1.0, "x_scale=10": 1e-3}, {}))).loc["far", "why"]
    assert far.startswith("not invariant (x_shift=5: 1 > 0.01)"), far
    near = verdicts(ood_rows(("near", {"none": 0.02, "x_shift=5": 0.03, "x_scale=10": 1e-3}, {}))).loc["near", "why"]
    assert near.startswith("inaccurate in distribution too (none: 0.02 > 0.01)"), near


def test_unmeasured_cells_counts_every_cell_without_an_error():
    """The count of cells without a relative error, not whether there is one: two errored cells
    (at N = 10 and N = 100) read 2."""
    frame = ood_rows(*[("two", {"none": 1e-6, "x_shift=5": math.nan, "x_scale=10": 1e-6}, {"N": n}) for n in (10, 100)],
                     ("two", {"none": 1e-6, "x_shift=5": 1e-6, "x_scale=10": 1e-6}, {"N": 1000}))
    got = verdicts(frame).loc["two"]
    assert got["unmeasured_cells"] == 2 and got["verdict"] == "neither"
    assert got["x_shift=5"] == pytest.approx(1e-6)  # the largest measured error



@pytest.mark.parametrize("shown", ["```markdown\n~~~\n<!-- t:begin -->\nexample\n<!-- t:end -->\n```\n",
                                   "```\n```python\n<!-- t:begin -->\nexample\n<!-- t:end -->\n```  \n"])
def test_a_fence_closes_only_with_its_own_character_and_nothing_after_it(tmp_path, shown):
    """CommonMark: a ~~~ line does not close a ``` fence, nor does a fence line with text after
    it ("```python"; a mutation review found markers after it rewritten); "```  " does. Markers
    inside the example are no block; the real block after it is rewritten."""
    from icl_bench.errors import ConfigError
    from icl_bench.report.docblock import replace_block

    doc = tmp_path / "doc.md"
    doc.write_text(shown)
    with pytest.raises(ConfigError, match="outside fenced code"):
        replace_block(doc, "t", "new")
    assert doc.read_text() == shown
    doc.write_text(shown + "<!-- t:begin -->\nold\n<!-- t:end -->\n")  # the real block after the example
    replace_block(doc, "t", "new")
    assert doc.read_text() == shown + "<!-- t:begin -->\nnew\n<!-- t:end -->\n"


def test_passes_per_sample_are_capped_for_a_nearly_free_pass(monkeypatch):
    """A pass of 1e-7 s would need 50 000 repeats to fill a 5 ms sample; the timer caps a sample
    at MAX_PASSES_PER_SAMPLE (1000) passes (a fake clock: no real timing)."""
    import icl_bench.bench.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing, "_clock", lambda: now[0])
    calls = []

    def run():
        calls.append(1)
        now[0] += 1e-7

    _, per_pass, samples, inner = timing.time_passes(run, "cpu", repeats=2, max_seconds=10.0, min_sample_s=0.005)
    assert inner == 1000 and samples == 2 and len(calls) == 1 + 2 * 1000
    assert per_pass == pytest.approx(1e-7)


def test_a_pass_the_clock_reads_as_zero_seconds_is_timed_without_error(monkeypatch):
    """A clock coarser than the pass (it reads the same before and after) gives a first pass of 0 s:
    the timer groups the most passes per sample instead of dividing by zero."""
    import icl_bench.bench.timing as timing

    monkeypatch.setattr(timing, "_clock", lambda: 42.0)
    result, per_pass, samples, inner = timing.time_passes(lambda: "done", "cpu", repeats=3, max_seconds=1.0)
    assert (result, per_pass, samples, inner) == ("done", 0.0, 3, timing.MAX_PASSES_PER_SAMPLE)


def test_the_input_files_digest_changes_when_bytes_move_between_files(tmp_path):
    """A cell's key hashes the files its solver reads: moving bytes from one file to the next
    (a config that grew while the weights file shrank) is another input, so another digest, though
    the bytes read in order are the same."""
    from icl_bench.bench.contract import files_digest

    a, b = tmp_path / "model.json", tmp_path / "model.safetensors"
    a.write_bytes(b'{"depth": 2}')
    b.write_bytes(b"WEIGHTS")
    before = files_digest([a, b])
    a.write_bytes(b'{"depth": 2}W')
    b.write_bytes(b"EIGHTS")
    assert files_digest([a, b]) != before
    a.write_bytes(b'{"depth": 2}')
    b.write_bytes(b"WEIGHTS")
    assert files_digest([a, b]) == before  # (the same files: the same digest)


def test_nan_on_an_ill_posed_prompt_is_not_counted_as_a_well_posed_failure():
    """n_nonfinite_well_posed counts the solver's own failures: a NaN where OLS has no answer (x
    constant) is the right answer there, and only the NaN on a well-posed prompt counts."""
    import torch

    from icl_bench import make_batch
    from icl_bench.bench.metrics import prediction_metrics

    x = [[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.0, 1.0, 3.0]]  # the second prompt is ill-posed
    batch = make_batch(x, [[1.0, 2.0, 3.0]] * 3, [4.0, 4.0, 4.0], R=10.0)
    m = prediction_metrics(torch.tensor([math.nan, math.nan, 5.5], dtype=torch.float64), batch)
    assert (m["n_nonfinite"], m["n_ill_posed"], m["n_nonfinite_well_posed"]) == (2, 1, 1)
    m = prediction_metrics(torch.tensor([4.0, math.nan, 5.5], dtype=torch.float64), batch)
    assert (m["n_nonfinite"], m["n_ill_posed"], m["n_nonfinite_well_posed"]) == (1, 1, 0)


RESULT = {"N": 10, "noise": 0.0, "R": 10.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none", "prompts": "{}",
          "solver_params": "{}", "mse_vs_ols": 0.5, "prompts_per_s": 100.0, "n_prompts": 8, "n_nonfinite": 0,
          "n_ill_posed": 0, "n_nonfinite_well_posed": 0, "seed": 0, "status": "ok", "message": ""}


def test_the_console_summary_lists_the_commonest_reasons_first_and_keeps_them():
    """Reasons are listed most cells first, and the ones beyond MAX_REASONS (8) left out are the
    rarest: the reason of 5 cells stays beside 10 reasons of one cell each."""
    from icl_bench.report.run_summary import MAX_REASONS, console_summary

    rows = [{**RESULT, "solver": "a"}]
    rows += [{**RESULT, "solver": "b", "status": "skipped", "message": f"rare reason {i}", "N": 100 + i} for i in range(10)]
    rows += [{**RESULT, "solver": "c", "status": "error", "message": "RuntimeError: boom", "N": n} for n in (20, 30, 40, 50, 60)]
    lines = console_summary(pd.DataFrame(rows)).splitlines()
    at = lines.index("15 cells not ok, by reason:")
    assert lines[at + 1] == "  error x5 [c]: RuntimeError: boom"
    assert sum(ln.startswith("  skipped x1 [b]: rare reason") for ln in lines) == MAX_REASONS - 1 == 7
    assert lines[-1] == "  ... and 3 more reasons (status and message of every cell: results.csv)"



SETTING = {"N": 10, "noise": 0.1, "R": 100.0, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"}


def test_the_prompt_sets_note_names_eight_series_per_set_and_counts_the_rest():
    from icl_bench.report import coverage

    rows = [{**SETTING, "series": f"s{i}", "seed": 0, "n_prompts": 256, "status": "ok", "run": "a"} for i in range(10)]
    rows += [{**SETTING, "series": "other", "seed": 1, "n_prompts": 256, "status": "ok", "run": "a"}]
    (note,) = coverage.prompt_sets_note(pd.DataFrame(rows), SETTING)
    assert "prompt seed 0 × 256 prompts: s0, s1, s2, s3, s4, s5, s6, s7 and 2 more; prompt seed 1 × 256 prompts: other;" \
        in note, note


def test_values_that_only_failed_are_not_offered_as_hidden_by_the_headline():
    """hidden_values lists the other d / ood values with ok cells, each with an --at that reaches
    them; a value where every cell errored or was skipped has nothing to show (--at refuses it:
    no ok cell), and failures.md lists it already."""
    from icl_bench.report import coverage

    t = pd.DataFrame([{**SETTING, "status": "ok", "run": "a", "series": "x"},
                      {**SETTING, "d": 2, "status": "error", "run": "a", "series": "x"},
                      {**SETTING, "ood": "x-shift:5", "status": "skipped", "run": "a", "series": "x"}])
    assert coverage.hidden_values(t, SETTING) == []
    t = pd.concat([t, pd.DataFrame([{**SETTING, "d": 3, "status": "ok", "run": "a", "series": "x"}])])
    assert coverage.hidden_values(t, SETTING) == ["d = 3: left out of the headline and of the plots, which show d = 1; "
                                                  "show another with --at (e.g. --at d=3)"]


def test_the_plot_hint_reaches_the_setting_with_the_most_values_among_the_nearest():
    """varied_elsewhere: of the settings as near to the plot's (one axis off), the one where x takes
    the most values: N = 100 (R = 1, 10, 100), not N = 30 (R = 1, 10)."""
    from icl_bench.report import plot_gaps

    row = {"noise": 0.1, "device": "cpu", "d": 1, "ood": "none", "mse_vs_ols": 1.0, "failed": False}
    summary = pd.DataFrame([{**row, "N": n, "R": r} for n, r in
                            ((20, 100.0), (30, 1.0), (30, 10.0), (100, 1.0), (100, 10.0), (100, 100.0))])
    setting = {"N": 20, "noise": 0.1, "device": "cpu", "d": 1, "ood": "none"}
    assert plot_gaps.varied_elsewhere(summary, setting, ("N", "noise", "device", "d", "ood"), "R") == (
        "the runs have R = 1, 10, 100 at N = 100; publish with --at N=100 to draw it")


def test_a_point_failed_in_one_panel_only_names_that_panel():
    """A failed first point (no line to break) is named in the note; where it failed in one noise
    panel of two, the note says which, since the other panel draws it."""
    from icl_bench.report import plot_gaps

    data = pd.DataFrame([{"series": "s", "series_rank": 0, "N": n, "noise": z, "failed": (n == 10 and z == 0.1)}
                         for n in (10, 20, 40) for z in (0.0, 0.1)])
    drawn, note = plot_gaps.gaps(data, "N", "noise")
    assert note == "not drawn, every cell errored or was skipped (failures.md): s at N = 10 (noise = 0.1)"
    assert not drawn["failed"].any() and len(drawn) == 5
    everywhere = data.assign(failed=data["N"] == 10)  # failed in both panels: no panel to name
    assert plot_gaps.gaps(everywhere, "N", "noise")[1].endswith(": s at N = 10")


@pytest.fixture(scope="module")
def two_source_report(tmp_path_factory):
    """Two tiny runs of ols at d = 2 (N = 2 is skipped there: no well-posed prompt), one on the
    default prompts and one on x ~ N(0, 2), published together."""
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_matrix
    from icl_bench.report.publish import publish

    root = tmp_path_factory.mktemp("mr5")
    base = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1}, "solvers": {"ols": {}},
            "grid": {"N": [2, 4, 8], "noise": [0.1], "R": [100.0], "dtype": ["float64"], "device": ["cpu"], "d": [2]}}
    runs = []
    for name, prompts in (("a", {}), ("b", {"x": {"dist": "normal", "loc": 0.0, "scale": 2.0}})):
        run_matrix(parse_config({**base, "prompts": prompts}), root / name, progress=False)
        runs.append(root / name)
    publish(runs, root / "pub")
    return runs, root / "pub"


def test_results_csv_stacks_every_row_of_every_run_failed_ones_too(two_source_report):
    """results.csv is every input row (module docstring), skipped and error cells included: they are
    what failures.md counts, and a reader of the CSV alone must see them."""
    runs, out = two_source_report
    rows = pd.concat([pd.read_parquet(r / "results.parquet") for r in runs])
    stacked = pd.read_csv(out / "results.csv")
    assert len(stacked) == len(rows) == 6
    assert sorted(stacked["status"]) == sorted(rows["status"]) == ["ok"] * 4 + ["skipped"] * 2
    assert set(stacked.loc[stacked["status"] == "skipped", "N"]) == {2}


def test_summary_md_keeps_the_prompt_source_column_when_the_runs_have_two(two_source_report):
    _, out = two_source_report
    header = (out / "summary.md").read_text().splitlines()[0]
    assert "| prompts " in header and '"scale": 2.0' in (out / "summary.md").read_text()


def test_the_scaling_note_holds_n_fixed_for_the_fit_against_r_and_r_for_the_fit_against_n(two_source_report):
    """index.html: the slope on log R is fitted at one N, the slope on log N at one R (as report.md
    says: "Against R at N = ...; against N at R = ...")."""
    import re

    _, out = two_source_report
    html = (out / "index.html").read_text()
    at_r, at_n = re.search(r"on log R \(at ([^)]*)\) and on log N \(at ([^)]*)\)", html).groups()
    assert at_r.startswith("N = ") and "R = " not in at_r, at_r
    assert at_n.startswith("R = ") and "N = " not in at_n, at_n
    md = (out / "report.md").read_text()
    assert f"Against R at {at_r}; against N at {at_n};" in md


def test_the_publish_command_keeps_force_and_readme_only_when_given():
    from icl_bench.report.publish import command_line

    assert command_line(["runs/a", "runs/b"], "site", {"N": "10"}, ["m"], force=True, readme="README.md") == (
        "icl-bench publish runs/a runs/b --out site --at N=10 --checkpoint m --readme README.md --force")
    assert command_line(["runs/a"], "my site", None, ()) == "icl-bench publish runs/a --out 'my site'"


def test_a_note_with_an_unpaired_backtick_keeps_it_as_text_on_the_page():
    """Notes are markdown for report.md; on index.html their `code` spans become <code>, escaped
    first. A lone backtick (a plugin's name, a message) opens no code span that would run to the
    end of the note."""
    from icl_bench.report.publish import _inline_code

    assert str(_inline_code("run `icl-bench docs report` <now>")) == "run <code>icl-bench docs report</code> &lt;now&gt;"
    assert str(_inline_code("the solver's `odd name")) == "the solver&#39;s `odd name"


def test_force_refuses_a_link_in_place_of_a_file_publish_wrote(tmp_path):
    """--force deletes only what publish wrote; publish never writes a link, so a link named like
    one of its files (a user's index.html -> their own page) is named, not deleted."""
    from icl_bench.errors import ConfigError
    from icl_bench.report import outdir

    out, mine = tmp_path / "pub", tmp_path / "my_page.html"
    out.mkdir()
    mine.write_text("my own page")
    (out / "publish.json").write_text(json.dumps({"files": ["index.html", "publish.json"]}))
    (out / "index.html").symlink_to(mine)
    with pytest.raises(ConfigError, match="holds index.html, which icl-bench publish did not write there"):
        outdir.check_out(out, [tmp_path / "run"], True)
    (out / "index.html").unlink()
    (out / "index.html").write_text("a report")  # control: the file itself is publish's
    outdir.check_out(out, [tmp_path / "run"], True)


def test_out_may_not_be_the_current_folder(tmp_path, monkeypatch):
    """publish renames its finished report onto --out: an empty current folder (`--out .`) would be
    replaced under the shell standing in it."""
    from pathlib import Path

    from icl_bench.errors import ConfigError
    from icl_bench.report import outdir

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for spelled in (".", str(here)):
        with pytest.raises(ConfigError, match="is the current folder; choose a subfolder"):
            outdir.check_out(Path(spelled), [tmp_path / "run"], False)
    outdir.check_out(here / "site", [tmp_path / "run"], False)  # a subfolder is fine


def test_a_readme_reached_through_a_link_into_out_is_refused(tmp_path):
    """--readme inside --out is refused (--force deletes it before its block is rewritten), also when
    it is spelled through a link to --out."""
    from icl_bench.errors import ConfigError
    from icl_bench.report import outdir

    out = tmp_path / "pub"
    out.mkdir()
    (tmp_path / "alias").symlink_to(out)
    with pytest.raises(ConfigError, match="--readme: .* is inside --out"):
        outdir.check_out(out, [tmp_path / "run"], False, readme=tmp_path / "alias" / "README.md")
    outdir.check_out(out, [tmp_path / "run"], False, readme=tmp_path / "README.md")  # beside it: fine


def test_a_local_runs_metadata_says_it_was_timed_exclusively(tmp_path, tiny_raw):
    """metadata.json's executor block of a local --exclusive-timing run says so (its rows are
    timed one cell per machine at a time; the cache serves them only to such runs)."""
    import tomli_w

    from icl_bench.cli import main

    raw = {**tiny_raw, "grid": {**tiny_raw["grid"], "N": [5], "noise": [0.0], "dtype": ["float64"]}}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    for flags, exclusive in (([], False), (["--exclusive-timing"], True)):
        out = tmp_path / f"run{exclusive}"
        assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(out), "--no-progress", *flags]) == 0
        meta = json.loads((out / "metadata.json").read_text())
        assert meta["executor"] == {"kind": "local", "exclusive_timing": exclusive}


def test_an_http_server_at_the_scheduler_address_is_named_as_no_dask_scheduler():
    """An HTTP server (the dashboard's port) answers distributed's handshake with "HTTP/1.1 ...",
    which distributed reads as a message length (a MemoryError of exabytes): the error says the
    address is likely not a Dask scheduler."""
    import socket
    import threading

    pytest.importorskip("distributed")
    from icl_bench.bench import executors
    from icl_bench.bench.config import Executor
    from icl_bench.errors import ConfigError

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)

    threading.Thread(target=serve, daemon=True).start()
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        with pytest.raises(ConfigError, match=rf"^executor.scheduler: cannot connect to '{address}' \(MemoryError: .*\); "
                                              r"is it a Dask scheduler\? \(not its dashboard's http port"):
            executors.DaskExecutor(Executor(kind="dask", scheduler=address))
    finally:
        server.close()
