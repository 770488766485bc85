"""What appears at publish's --out while it runs is never deleted (found by a review: the first
check of --out came minutes before the report was moved in, and the move deleted whatever was
there by then, without --force too)."""
import pytest
import tomli_w

import icl_bench.report.publish as publish_mod
from icl_bench.cli import main


@pytest.fixture
def run_dir(tmp_path, tiny_raw):
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    return tmp_path / "run"


def _writes_during_publish(monkeypatch, path, text="my only copy"):
    """While publish draws its figures (after its first check of --out), write `path`."""
    figures = publish_mod._figures

    def and_write(*a, **k):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return figures(*a, **k)
    monkeypatch.setattr(publish_mod, "_figures", and_write)


@pytest.mark.parametrize("empty_before", [False, True])
def test_a_file_written_to_out_during_publish_survives(tmp_path, run_dir, monkeypatch, capsys, empty_before):
    out = tmp_path / "pub"
    if empty_before:
        out.mkdir()
    _writes_during_publish(monkeypatch, out / "precious.txt")
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"icl-bench: error: --out: {out} is not empty and icl-bench publish did not write it (no "
                   "publish.json); only an earlier report can be replaced (--force): choose an empty or new folder (it "
                   "changed while publish ran; nothing was replaced)\n")
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (out / "precious.txt").read_text() == "my only copy"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pub.")]  # no temp folder left


def test_force_rechecks_what_appeared_in_an_earlier_report(tmp_path, run_dir, monkeypatch, capsys):
    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    _writes_during_publish(monkeypatch, out / "notes.md")
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err.startswith(f"icl-bench: error: --out: {out} holds notes.md, which icl-bench publish "
                                              "did not write there")
    assert (out / "notes.md").read_text() == "my only copy" and (out / "index.html").is_file()


def test_an_empty_out_and_force_still_publish(tmp_path, run_dir):
    out = tmp_path / "pub"
    out.mkdir()
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0 and (out / "index.html").is_file()
    old = (out / "index.html").stat().st_ino  # (the new report is written while the old one exists)
    assert main(["publish", str(run_dir), "--out", str(out), "--force"]) == 0
    assert (out / "index.html").stat().st_ino != old


@pytest.mark.parametrize("name", ["report.md", "plots/mse_vs_n.png"])
def test_force_refuses_a_report_whose_files_were_edited(tmp_path, run_dir, capsys, name):
    """A user's notes added to report.md were deleted by the next --force, which compared names
    only (found by a review): publish.json keeps each file's sha256, and an edited file is named."""
    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    with open(out / name, "ab") as f:
        f.write(b"MY NOTES")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err == (f"icl-bench: error: --out: {out} holds {name}, edited since icl-bench publish "
                                       "wrote it; --force would delete it: move it out or choose another folder\n")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_an_unwritable_out_is_refused_before_the_work(tmp_path, run_dir, monkeypatch, capsys):
    """--out under a read-only folder was reported only after every table and plot was made (a
    review: 8-9 s on a 504-cell run); the temporary folder beside --out is now made first."""
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".pub.x.tmp"))
    monkeypatch.setattr(publish_mod.tempfile, "mkdtemp", denied)
    drawn = []
    monkeypatch.setattr(publish_mod, "_figures", lambda *a, **k: drawn.append(1))
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "pub")]) == 2
    assert capsys.readouterr().err == f"icl-bench: error: --out: {tmp_path / 'pub'}: Permission denied\n"
    assert drawn == [] and not (tmp_path / "pub").exists()


def test_force_checks_the_old_report_once_more_after_moving_it_aside(tmp_path, run_dir, monkeypatch, capsys):
    """A file written between the recheck and the move was deleted with the old report (a review)."""
    import icl_bench.report.outdir as outdir

    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    check, calls = outdir.check_out, []

    def and_then_write(o, *a, **k):
        check(o, *a, **k)
        calls.append(o)
        if len(calls) == 2:  # the recheck just passed
            (o / "late.txt").write_text("user data")
    monkeypatch.setattr(outdir, "check_out", and_then_write)
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(out), "--force"]) == 2
    assert capsys.readouterr().err == (f"icl-bench: error: --out: {out} holds late.txt, which icl-bench publish did not "
                                       "write there (while publish ran); nothing was replaced\n")
    assert (out / "late.txt").read_text() == "user data" and (out / "index.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "pub", "run"]  # no folder left beside it


def test_the_recheck_names_out_as_typed_when_it_is_a_link(tmp_path, run_dir, monkeypatch, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    _writes_during_publish(monkeypatch, tmp_path / "real" / "precious.txt")
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "link")]) == 2
    assert capsys.readouterr().err.startswith(f"icl-bench: error: --out: {tmp_path / 'link'} is not empty")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "precious.txt").read_text() == "my only copy"
