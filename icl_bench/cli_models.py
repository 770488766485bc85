"""`icl-bench analyze`, `train` and `sweep`: the handlers of the commands about trained models
(icl_bench/cli.py parses the command line and calls them; exit codes there)."""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from icl_bench import resources
from icl_bench.config_base import MAX_SEED, MAX_THREADS
from icl_bench.errors import ConfigError
from icl_bench.files import drop_made_folders, first_existing, refuse_link_loop


def cmd_analyze(args) -> int:
    """Print the headline numbers, the sparsity per parameter and the alignment of a checkpoint;
    write every number to --out as standard JSON."""
    from icl_bench.analysis.analyze import HEADLINE, LABELS, analyze_checkpoint, check_out
    from icl_bench.analysis.fingerprint import DIVERGED, transforms
    from icl_bench.startup import torch_threads
    from icl_bench.files import write_json
    from icl_bench.solvers.checkpoint import checkpoint_path, shadows_shipped

    if args.out is not None:
        check_out(args.out)
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed: must be an integer in [0, {MAX_SEED}] (got {args.seed})")
    if not 0 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads: must be an integer in [0, {MAX_THREADS}] (got {args.threads}); 0 = torch's default")
    try:
        path = checkpoint_path(args.checkpoint)
    except ConfigError as exc:  # a solver's name: its mechanism is read from its answers (a new-user tryout)
        from icl_bench.solvers.registry import known_names

        if args.checkpoint not in known_names():
            raise
        raise ConfigError(f"{exc}; {args.checkpoint!r} is a solver, which analyze cannot read: its behavioural "
                          f"fingerprint is the Mechanism table of `icl-bench run --config ood --solver "
                          f"{args.checkpoint}` then `icl-bench publish`, whose verdict judges x-shifts up to 5 and "
                          "x-scales 0.1-10 only (docs/report.md), where analyze's fingerprint of a checkpoint also "
                          "weighs x+20, so the two can differ (docs/analysis.md)") from None
    try:
        with torch_threads(args.threads):  # the fingerprint's GD trajectories are many small ops
            result = analyze_checkpoint(path, n_prompts=args.n_prompts, seed=args.seed, N=args.N)
    except ConfigError as exc:  # name the flag the user typed, not the argument it set
        msg = str(exc)
        for key, flag in (("n_prompts:", "--n-prompts:"), ("N:", "--N:"), ("seed:", "--seed:")):
            msg = flag + msg[len(key):] if msg.startswith(key) else msg
        raise ConfigError(msg) from None
    if path != args.checkpoint:  # a shipped model: its place in the package, not this machine's path
        result["checkpoint"] = f"icl_bench/models/{Path(path).name}"
    elif shadows_shipped(args.checkpoint, path):  # a local pair takes a shipped model's name
        print(f"note: {path} is the checkpoint in this folder ({Path(path).resolve().parent}), not the shipped "
              "model of that name (give ./NAME or the package's path to be explicit)", file=sys.stderr)
        result["checkpoint"] = str(Path(path).resolve())
    fmt = lambda v: "nan" if v is None or v != v else f"{v:.4g}"  # noqa: E731
    print(f"{'prompts':26s} N = {result['N']} (mechanism tests ln.*, fp.*: N = {result['mechanism_N']}), R = "
          f"{result['R']:g}, noise {result['noise']:g}, {result['n_prompts']} prompts, seed {result['seed']}")
    last = max((int(m[1]) for k in result if (m := re.fullmatch(r"ln\.ln(\d+)\.slope", k))), default=1)
    deeper = [f"ln.ln{i}.{f}" for i in range(2, last + 1) for f in ("slope", "r2", "r2_raw", "freeze")]  # 3+ layers:
    at = HEADLINE.index("ln.ln1.freeze") + 1  # the last LayerNorm decides ln.state (in --out only before: a review)
    labels = {k: v for k, v in LABELS.items() if k != "ln.ln1.r2_raw"}  # r2_raw's rule is the last LayerNorm's
    labels[f"ln.ln{last}.r2_raw"] = LABELS["ln.ln1.r2_raw"].replace("ln.ln1.", f"ln.ln{last}.")
    for k in (*HEADLINE[:at], *deeper, *HEADLINE[at:]):
        none = "n/a"  # not computed: not in --out either
        if k.startswith("ln.ln"):  # a 1-layer model with LayerNorm has no ln1 (it read "no LayerNorm"; a review)
            none = "n/a (no second layer)" if "ln.ln0.slope" in result else "n/a (no LayerNorm)"
        print(f"{k:26s} {fmt(float(result[k])) if k in result else none} {labels.get(k, '') if k in result else ''}".rstrip())
    # (the gap read "worst map x*10 3.354", like a relative error: a tryout)
    closest = (f"closest gd: K={result.get('fp.gd_steps')}, lr {fmt(result.get('fp.gd_lr'))}, mean distance "
               f"{fmt(result.get('fp.gd_distance'))} decades, largest gap {fmt(result.get('fp.gd_max_gap'))} decades at "
               f"map {result.get('fp.gd_worst_map')}")
    if all(result.get(f"fp.{t.name}", 0) >= DIVERGED for t in transforms()):  # no answer on any map: a "closest
        closest = f"every map diverged or answered NaN / inf (scored {DIVERGED:g}): no gd to compare"  # gd" is noise
    print(f"{'state (functional LN)':26s} {result.get('ln.state')}\n{'fingerprint verdict':26s} "
          f"{result.get('fp.verdict')} ({closest})")
    print(f"{'per matrix':26s} sparsity   l1         hoyer")
    for name, v in json.loads(result["per_matrix"]).items():
        print(f"  {name:24s} {fmt(v['sparsity']):10s} {fmt(v['l1']):10s} {fmt(v['hoyer'])}")
    print(f"{'alignment':26s} {result['alignment']}")
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result, sort_keys=True)  # atomic: an old file survives a crash intact
        print(f"wrote {args.out}")
    return 0


def cmd_train(args) -> int:
    """Train every selected run of --config one after another (one process, one thread each)."""
    from icl_bench.config_base import read_toml
    from icl_bench.training.config import MAX_STEPS, TrainConfig, load_runs
    from icl_bench.training.train import train_and_save
    from icl_bench.solvers.checkpoint import check_writable, stem_of

    if args.steps is not None and not 1 <= args.steps <= MAX_STEPS:
        raise ConfigError(f"--steps: must be an integer >= 1 and <= {MAX_STEPS} (got {args.steps})")
    if not str(args.out).strip():  # (it saved into the current folder; run, --cache and analyze refuse it: a review)
        raise ConfigError("--out: empty path; give a folder")
    path = resources.config_path(args.config)
    doc = read_toml(path)
    resources.check_kind(doc, args.config, "train")
    labelled = load_runs(path, args.run, labelled=True)
    cfgs = []
    for where, d in labelled:  # every run, before hours of training
        try:
            cfgs.append(TrainConfig.from_dict(d, where=where))
        except ConfigError as exc:  # a key [defaults] set is named there, not in the run's table (a review)
            field = str(exc).removeprefix(f"{where}.").split(":")[0].split(".")[0]
            at = _field_at(doc, where, field)
            raise (ConfigError(at + str(exc)[len(f"{where}.{field}"):]) if at != f"{where}.{field}" else exc) from None
    lr_at = {c.name: _field_at(doc, where, "lr") for c, (where, _) in zip(cfgs, labelled)}
    cfgs = [c.model_copy(update={"progress": c.progress and not args.no_progress}) for c in cfgs]
    if args.steps is not None:  # a quick check of a packaged config: fewer steps, same recipe
        cfgs = [c.model_copy(update={"steps": args.steps, "eval_every": min(c.eval_every, args.steps)}) for c in cfgs]
    out = Path(args.out)
    refuse_link_loop(out, "--out")  # not "--out: loop1: File exists"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} exists and is not a folder")
    pairs = [Path(f"{stem_of(out / c.name)}{s}") for c in cfgs for s in (".safetensors", ".json")]  # as saved:
    used = [p.name for p in pairs if p.exists() or p.is_symlink()]  # name "x.json" saves x.json + x.safetensors
    if used and not args.force:  # like run / publish: a checkpoint is never overwritten silently
        raise ConfigError(f"--out: {out} already holds {', '.join(used)}; choose another folder or pass --force")
    for c in cfgs:  # e.g. a folder named m.json: refused now, not after the training
        check_writable(out / c.name)
    made = first_existing(out)  # above the folders this command makes
    out.mkdir(parents=True, exist_ok=True)  # an OSError here is one line, exit 2 (main)
    done = []
    try:
        for cfg in cfgs:  # (a pair saved meanwhile by another train is kept)
            stem = train_and_save(cfg, out, replace=args.force, where=lr_at[cfg.name])
            done.append(cfg.name)
            meta = json.loads(Path(f"{stem}.json").read_text())["metrics"]
            num = lambda k, f: "nan" if meta.get(k) is None else format(meta[k], f)  # noqa: E731 (null = NaN: diverged)
            print(f"{cfg.name}: {meta['step']} step{'' if meta['step'] == 1 else 's'}, held-out MSE vs OLS {num('eval_mse_vs_ols', '.3e')} "
                  f"({num('eval_rel_mse', '.2%')} of var(OLS)), sparsity {num('sparsity', '.2f')} -> {stem}.safetensors",
                  flush=True)
    except (KeyboardInterrupt, ConfigError) as exc:  # (a diverged run: one line, which main prints)
        drop_made_folders(out, made)  # nothing saved: no empty folder it made is left behind (a review)
        if isinstance(exc, KeyboardInterrupt) and len(done) < len(cfgs):  # (a Ctrl-C in the final evaluation,
            print(f"icl-bench: {cfgs[len(done)].name} is not saved: interrupted while training or "  # after every
                  "evaluating it", file=sys.stderr, flush=True)  # step, discarded the run unsaid: a review)
        if isinstance(exc, KeyboardInterrupt) and done and len(done) < len(cfgs):  # how to train the rest
            print(f"icl-bench: saved in {out}: {', '.join(done)}; train the rest with:\n  "
                  f"{_rest_command(getattr(args, 'argv', None), [c.name for c in cfgs if c.name not in done])}",
                  file=sys.stderr, flush=True)
        raise
    return 0


def _field_at(doc: dict, where: str, field: str) -> str:
    """The key that sets a run's `field`, for an error or a divergence message: `<where>.<field>`
    ("train" for a flat config, "runs.NAME"), or `defaults.<field> (run NAME)` when the run's table
    leaves it to [defaults] (a review)."""
    name = where.removeprefix("runs.")
    table = doc["runs"].get(name) if where.startswith("runs.") and isinstance(doc.get("runs"), dict) else None
    defaults = doc.get("defaults") if isinstance(doc.get("defaults"), dict) else {}
    if isinstance(table, dict) and field not in table and field in defaults:
        return f"defaults.{field} (run {name})"
    return f"{where}.{field}"


def _rest_command(argv: list[str] | None, names: list[str]) -> str:
    """The `icl-bench train ...` line that trains only the runs `names` (argv's --run flags replaced)."""
    rest, skip = [], False
    run = lambda a: len(a) >= 4 and "--run".startswith(a)  # noqa: E731 (argparse takes --ru for --run too)
    for a in argv or ["train"]:
        if skip:
            skip = False
        elif run(a):
            skip = True
        elif not run(a.split("=", 1)[0]):
            rest.append(a)
    return shlex.join(["icl-bench", *rest, *(x for n in names for x in ("--run", n))])


def cmd_sweep(args) -> int:
    """Train an l1 sweep (lambda grid x seeds) and write its tables."""
    from icl_bench.config_base import read_toml
    from icl_bench.training.sweep import run_sweep

    path = resources.config_path(args.config)
    resources.check_kind(read_toml(path), args.config, "sweep")
    command = shlex.join(["icl-bench", *getattr(args, "argv", ["sweep", "--config", str(args.config)])])
    run_sweep(path, reuse=args.reuse, progress=not args.no_progress, force=args.force, command=command)
    return 0
