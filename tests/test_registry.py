import re
import subprocess
import sys

import pytest
import torch

from icl_bench import Solver, get_solver, list_solvers, register_solver
from icl_bench.bench.config import parse_config
from icl_bench.solvers.registry import SolverLoadError, UnknownSolverError, get_solver_class
from icl_bench.bench.runner import run_matrix


def test_unknown_name_lists_known_and_closest():
    with pytest.raises(UnknownSolverError) as info:
        get_solver("scipy-lstq")
    msg = str(info.value)
    assert "known: " in msg and "ols" in msg and "did you mean 'scipy-lstsq'?" in msg


def test_baselines_come_from_the_entry_point_group():
    infos = {i.name: i for i in list_solvers()}
    assert infos["ols"].origin.startswith("plugin icl_bench_baselines.ols:OLS")
    assert infos["scipy-lstsq"].origin.startswith("plugin icl_bench_baselines.scipy_lstsq:")


def test_unknown_parameter_and_bad_type():
    with pytest.raises(ValueError, match=r"solvers\.ols\.steps: unknown parameter"):
        get_solver("ols", steps=3)


def test_plugin_is_listed_and_used_by_the_runner(plugin_path, tiny_raw):
    infos = {i.name: i for i in list_solvers()}
    assert infos["plugin-mean-y"].origin.startswith("plugin fake_plugin_good:MeanY (fake-icl-plugin 1.0)")
    assert "shift" in infos["plugin-mean-y"].params
    tiny_raw["solvers"] = {"plugin-mean-y": {"shift": [0.0, 1.0]}, "ols": {}}
    table = run_matrix(parse_config(tiny_raw), progress=False)
    mine = table[table.solver == "plugin-mean-y"]
    assert len(mine) == 2 * 8 and (mine.status == "ok").all()
    assert set(mine.solver_params) == {'{"shift": 0.0}', '{"shift": 1.0}'}
    assert (mine.mse_vs_ols > 0.01).all()  # a mean-of-y predictor is far from OLS


def test_broken_plugin_breaks_nothing_else(plugin_path, tiny_raw):
    infos = {i.name: i for i in list_solvers()}
    assert "this plugin is broken on purpose" in infos["plugin-broken"].error
    assert infos["ols"].error is None
    with pytest.raises(SolverLoadError, match="broken on purpose"):
        get_solver_class("plugin-broken")
    tiny_raw["solvers"] = {"plugin-broken": {}, "ols": {}}
    table = run_matrix(parse_config(tiny_raw), progress=False)
    assert (table[table.solver == "plugin-broken"].status == "error").all()
    assert (table[table.solver == "ols"].status == "ok").all()


def test_cli_list_survives_a_broken_plugin(plugin_path):
    env_path = f"{plugin_path}"
    out = subprocess.run([sys.executable, "-m", "icl_bench", "list"], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": env_path})
    assert out.returncode == 0, out.stderr
    assert "plugin-broken" in out.stdout and "BROKEN: ImportError: this plugin is broken on purpose" in out.stdout
    assert "plugin-mean-y" in out.stdout and "\n    shift = 0.0  (float)" in out.stdout
    assert "scipy-lstsq" in out.stdout


PLAIN_PARAMS = '''
from icl_bench import Solver


class PlainParams(Solver):
    """A plugin that wrote its parameter's default where a Param belongs."""
    params = {"shift": 0.0}

    def predict(self, batch):
        return batch.y.mean(dim=1)
'''


def test_a_plugin_whose_params_are_not_param_is_listed_as_broken(tmp_path, monkeypatch, capsys):
    """`params = {"shift": 0.0}` crashed `icl-bench list` with a traceback, and the solvers after
    it were never listed (found by a new-user tryout); it is now a broken plugin like any other."""
    from icl_bench.cli import main
    from icl_bench.solvers import registry

    from conftest import write_plugin

    root = write_plugin(tmp_path / "site", "plain-plugin", {"plain-params": "plain_mod:PlainParams"},
                        {"plain_mod": PLAIN_PARAMS})
    monkeypatch.syspath_prepend(str(root))
    try:
        assert main(["list"]) == 0
        out = capsys.readouterr().out
        assert "BROKEN: TypeError: solver 'plain-params': params['shift'] must be an icl_bench.Param (got 0.0)" in out
        assert "\nscipy-lstsq  [" in out  # the listing goes on after it
    finally:
        registry.REGISTRY.unregister("plain-params")
        sys.modules.pop("plain_mod", None)


@pytest.mark.parametrize("params, expected", [
    ("{1: Param(0.0, 'x')}", "parameter name 1 must be an identifier (a config key)"),  # listed as "1 = 0.0"
    ("{'shift': Param(float('nan'), 'x')}", "the default of 'shift' fails its own check (solvers.odd.shift: must be finite"),
    # listed as `sizes = [8, 8]` and `seed = None`, but no config could set them (a list is a grid; TOML has no None)
    ("{'sizes': Param([8, 8], 'x')}", "the default of 'sizes' must be a bool, int, float or str, the values a config "
                                      "can give (got list [8, 8])"),
    ("{'seed': Param(None, 'x')}", "the default of 'seed' must be a bool, int, float or str, the values a config can "
                                   "give (got NoneType None)"),
])
def test_odd_plugin_parameters_are_a_broken_plugin_with_its_version_on_record(tmp_path, monkeypatch, params, expected):
    """Found by a review: an int key was listed and failed in the runner; a NaN default blamed the
    user's config for a value they never set. A broken plugin's origin keeps its version."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    src = PLAIN_PARAMS.replace("from icl_bench import Solver", "from icl_bench import Param, Solver")
    src = src.replace('params = {"shift": 0.0}', f"params = {params}")
    root = write_plugin(tmp_path / "site", "odd-plugin", {"odd": "odd_mod:PlainParams"}, {"odd_mod": src})
    monkeypatch.syspath_prepend(str(root))
    try:
        info = {i.name: i for i in list_solvers()}["odd"]
        assert expected in info.error, info.error
        assert registry.REGISTRY.origin("odd") == "plugin odd_mod:PlainParams (odd-plugin 1.0), broken"
    finally:
        registry.REGISTRY.unregister("odd")
        sys.modules.pop("odd_mod", None)


def test_list_shows_parameters_as_config_keys_not_flags(capsys):
    from icl_bench import Param
    from icl_bench.cli import main

    assert Param(16, "K steps", min=1, max=4096).describe("steps") == "steps = 16  (int >= 1, <= 4096)  K steps"
    assert Param(0.4, "eta", gt=0.0).describe("lr") == "lr = 0.4  (float > 0)  eta"
    assert Param("masked", "key set", ("masked", "query-in-context")).describe("variant") == \
        'variant = "masked"  (one of "masked" | "query-in-context")  key set'
    assert Param(False, "").describe("standardize") == "standardize = false  (bool)"
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "    steps = 16  (int >= 1, <= 4096)  K, the number of LSA layers = GD steps" in out
    assert not [line for line in out.splitlines() if line.lstrip().startswith("--")]  # nothing looks like a flag
    assert "Parameters are config keys, not command-line flags: set them in a matrix config's [solvers.NAME] table" in out


@pytest.fixture
def failing_solver():
    """A registered solver whose constructor raises a plain (multi-line) ValueError."""
    from icl_bench import Param, Solver, register_solver
    from icl_bench.solvers.registry import REGISTRY

    @register_solver("test-init-fails")
    class InitFails(Solver):
        """Fails to build, as a plugin with a bug would."""
        params = {"k": Param(1, "a parameter")}

        def __init__(self, **values):
            super().__init__(**values)
            raise ValueError("boom from plugin\nTraceback (most recent call last):\n  inside the plugin")

        def predict(self, batch):  # pragma: no cover - never built
            raise AssertionError
    yield "test-init-fails"
    REGISTRY.unregister("test-init-fails")


def test_a_solver_that_fails_to_build_gives_error_rows_not_a_config_error(failing_solver, tiny_raw, tmp_path, capsys):
    from icl_bench.cli import main
    import tomli_w

    tiny_raw["grid"] = {"N": [5], "noise": [0.1], "R": [100.0], "dtype": ["float64"]}
    tiny_raw["solvers"] = {failing_solver: {"k": [1, 2]}, "ols": {}}
    cfg = parse_config(tiny_raw)  # was: ConfigError("boom from plugin ...") with no field
    assert cfg.solvers[failing_solver] == [{"k": 1}, {"k": 2}]
    table = run_matrix(cfg, progress=False)
    mine = table[table.solver == failing_solver]
    assert len(mine) == 2 and (mine.status == "error").all() and (table[table.solver == "ols"].status == "ok").all()
    assert mine.message.str.startswith("ValueError: boom from plugin Traceback").all()  # one line per row
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--no-progress"]) == 1
    assert "error: test-init-fails" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^solvers\.test-init-fails\.k: expected int"):  # parameter errors still refused
        parse_config({**tiny_raw, "solvers": {failing_solver: {"k": "x"}}})


SHADOW = '''
    from icl_bench import Solver

    class Shadow(Solver):
        """Predict the context mean of y under someone else's name."""

        def predict(self, batch):
            return batch.y.mean(dim=1)
'''


def test_a_plugin_cannot_take_the_name_of_icl_benchs_own_baselines(tmp_path, monkeypatch):
    """A distribution earlier on sys.path declaring `ols` used to replace the reference baseline
    (its numbers under the name `ols`); icl-bench's own declarations now win, and the plugin is
    reported as ignored (found by a new-user tryout)."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    root = write_plugin(tmp_path / "site", "shadow-plugin", {"ols": "shadow_mod:Shadow"}, {"shadow_mod": SHADOW})
    monkeypatch.syspath_prepend(str(root))
    registry.REGISTRY.unregister("ols")
    try:
        assert registry.REGISTRY.entry_points()["ols"].value == "icl_bench_baselines.ols:OLS"
        assert get_solver_class("ols").__module__ == "icl_bench_baselines.ols"
        assert any("shadow_mod:Shadow" in line and "ignored" in line for line in registry.conflicts())
    finally:
        registry.REGISTRY.unregister("ols")
        sys.modules.pop("shadow_mod", None)


def test_a_clash_in_one_folder_is_decided_by_distribution_name(tmp_path, monkeypatch):
    """Two distributions in one folder declaring one name: the folder's listing order (the file
    system's) used to decide; now the distribution whose name sorts first wins."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    site = tmp_path / "site"
    write_plugin(site, "zzz-plugin", {"clash-name": "zzz_mod:Shadow"}, {"zzz_mod": SHADOW})
    write_plugin(site, "aaa-plugin", {"clash-name": "aaa_mod:Shadow"}, {"aaa_mod": SHADOW})
    monkeypatch.syspath_prepend(str(site))
    assert registry.REGISTRY.entry_points()["clash-name"].value == "aaa_mod:Shadow"
    assert [line for line in registry.conflicts() if "clash-name" in line] == [
        "plugin zzz_mod:Shadow (zzz-plugin) declares 'clash-name', already declared by aaa_mod:Shadow: ignored"]


@pytest.mark.parametrize("name, expected", [
    ("ols", "a built-in name (of icl_bench_baselines.ols)"),
    ("gd-lsa", "a built-in name (of icl_bench.solvers.gd_lsa)"),
    ("OLS", "differs from the built-in name 'ols' only in case or Unicode form"),
    ("\uff4f\uff4c\uff53", "differs from the built-in name 'ols' only in case or Unicode form"),  # fullwidth: NFKC 'ols' (a review)
    ("\u043els", "mixes Latin letters with CYRILLIC ones, which include look-alikes of Latin letters"),  # Cyrillic 'о'
    ("gd-\u03bfls", "mixes Latin letters with GREEK ones, which include look-alikes of Latin letters"),  # Greek 'ο'
])
def test_register_solver_refuses_a_built_in_name_before_the_built_in_loaded(name, expected):
    """`@register_solver("ols")` from a notebook replaced the reference baseline whenever it came
    before `ols` was first used (a review): its rows read as OLS. Refused now, loaded or not."""
    from icl_bench.solvers import registry

    class Impostor(Solver):
        """Answers 0."""
        params = {}

        def predict(self, batch):
            return torch.zeros_like(batch.x_query)

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)  # a fresh process: nothing loaded
    with pytest.raises(ValueError, match=re.escape(f"solver {name!r}: {expected}; choose another name")):
        fresh.add(name, Impostor, origin="built-in (__main__)")
    if name == "ols":  # the decorator too, on the suite's registry (ols loads again from its entry point)
        registry.REGISTRY.unregister("ols")
        with pytest.raises(ValueError, match="a built-in name"):
            register_solver("ols")(Impostor)
        assert get_solver_class("ols").__module__ == "icl_bench_baselines.ols"


def test_a_plugin_named_as_a_built_in_in_other_case_is_ignored(tmp_path, monkeypatch):
    """A plugin declaring `OLS` ran beside `ols` and its row sat next to the reference's in the
    headline (a review); it is now ignored, with a line in `conflicts`, and a name the plugin's own
    package registers with the decorator is still its own."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    root = write_plugin(tmp_path / "site", "case-plugin", {"OLS": "case_mod:Shadow", "case-own": "case_mod:Shadow"},
                        {"case_mod": SHADOW})
    monkeypatch.syspath_prepend(str(root))
    try:
        assert "OLS" not in registry.REGISTRY.entry_points() and "OLS" not in registry.known_names()
        assert ("plugin case_mod:Shadow (case-plugin) declares 'OLS', the built-in name 'ols' in other case: ignored"
                in registry.conflicts())
        with pytest.raises(ValueError, match="declared by plugin case_mod:Shadow"):
            register_solver("case-own")(type("Other", (Solver,), {"params": {}, "__module__": "elsewhere"}))
        assert get_solver_class("case-own").__module__ == "case_mod"
    finally:
        registry.REGISTRY.unregister("case-own")
        sys.modules.pop("case_mod", None)


def test_run_warns_of_a_shadowed_plugin_name_before_the_config_is_refused(tmp_path, monkeypatch, capsys):
    """A plugin whose name an earlier distribution already declares is ignored; `run` printed that
    WARNING only once the config had parsed, so a config refused for a parameter only the ignored
    plugin has said `unknown parameter` with nothing to explain it (a review)."""
    from icl_bench.cli import main

    from conftest import GOOD_PLUGIN, write_plugin

    site = tmp_path / "site"
    write_plugin(site, "zzz-plugin", {"warn-clash": "zzz_mean:MeanY"}, {"zzz_mean": GOOD_PLUGIN})
    write_plugin(site, "aaa-plugin", {"warn-clash": "aaa_shadow:Shadow"}, {"aaa_shadow": SHADOW})
    monkeypatch.syspath_prepend(str(site))
    cfg = tmp_path / "c.toml"
    cfg.write_text('[grid]\nN = [4]\n[solvers.warn-clash]\nshift = [1.0]\n')
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["icl-bench: WARNING: plugin zzz_mean:MeanY (zzz-plugin) declares 'warn-clash', already declared by "
                   "aaa_shadow:Shadow: ignored",
                   "icl-bench: error: solvers.warn-clash.shift: unknown parameter; accepted: (none)"], err


def test_a_built_in_loads_again_after_a_reset():
    """After REGISTRY.reset() (tests, notebooks) `gd-lsa` was "unknown name 'gd-lsa'; known: ...
    gd-lsa": its module, imported before, did not register again (a review). A fresh registry in a
    process that imported the built-ins is the same situation."""
    from icl_bench.solvers import registry

    get_solver_class("gd-lsa"), get_solver_class("trained-nol1")  # their modules are imported
    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    assert fresh.get_class("gd-lsa") is get_solver_class("gd-lsa")
    assert fresh.get_class("trained-nol1") is get_solver_class("trained-nol1")
    assert fresh.origin("gd-lsa") == "built-in (icl_bench.solvers.gd_lsa)"


DECO_CORE = '''
    import torch
    from icl_bench import Solver, register_solver

    @register_solver("deco-solver")
    class Deco(Solver):
        """Registers itself with the decorator, in a package other than its entry point's."""
        params = {}

        def predict(self, batch):
            return batch.y.mean(dim=1)
'''


def test_a_plugin_may_register_its_own_name_from_another_package(tmp_path, monkeypatch):
    """The name check took a plugin's decorator, in a package other than the one its entry point
    names, for an impostor: the plugin was listed BROKEN (a review). While a name's entry point
    loads, what it imports may register that name; a stray name is still refused."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    root = write_plugin(tmp_path / "site", "deco-plugin", {"deco-solver": "deco_ep:Deco"},
                        {"deco_ep": "from deco_core import Deco\n", "deco_core": DECO_CORE})
    monkeypatch.syspath_prepend(str(root))
    try:
        cls = get_solver_class("deco-solver")
        assert cls.__module__ == "deco_core"
        assert registry.REGISTRY.origin("deco-solver") == "plugin deco_ep:Deco (deco-plugin 1.0)"
    finally:
        registry.REGISTRY.unregister("deco-solver")
        sys.modules.pop("deco_ep", None)
        sys.modules.pop("deco_core", None)


@pytest.mark.parametrize("name", ["ols ", " gd", ""])
def test_a_name_with_surrounding_spaces_is_refused(name):
    """`register_solver('ols ')` ran beside `ols`; the tables strip labels, so the console summary
    averaged the two under `ols` and the published report dropped one (a review)."""
    from icl_bench.solvers import registry

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    with pytest.raises(ValueError, match="a name must be non-empty text without leading or trailing spaces"):
        fresh.add(name, type("Spaced", (Solver,), {"params": {}, "predict": lambda s, b: b.x_query}), origin="x")


@pytest.mark.parametrize("name", ["\u200b", "my\u200bols", "two\nlines", "tab\there"])
def test_a_name_with_invisible_or_control_characters_is_refused(name):
    """A zero-width space passed as a name: its rows had an invisible solver label (a review)."""
    from icl_bench.solvers import registry

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    with pytest.raises(ValueError, match="a name must be printable text"):
        fresh.add(name, type("Hidden", (Solver,), {"params": {}, "predict": lambda s, b: b.x_query}), origin="x")


def test_a_class_registered_while_a_plugin_loads_cannot_take_its_name(tmp_path, monkeypatch):
    """While `foo`'s entry point loaded, a helper module it imported could register its own class
    as `foo`, and lookups returned that class (another solver's numbers under `foo`: a review)."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    helper = DECO_CORE.replace('"deco-solver"', '"taken-name"').replace("Deco", "Helper")
    entry = "import taken_helper\nfrom deco_core import Declared\n"
    root = write_plugin(tmp_path / "site", "taken-plugin", {"taken-name": "taken_ep:Declared"},
                        {"taken_ep": entry, "taken_helper": helper, "deco_core": SHADOW_DECLARED})
    monkeypatch.syspath_prepend(str(root))
    try:
        cls = get_solver_class("taken-name")
        assert cls.__module__ == "deco_core" and cls.__name__ == "Declared"
        assert registry.REGISTRY.origin("taken-name") == "plugin taken_ep:Declared (taken-plugin 1.0)"
    finally:
        registry.REGISTRY.unregister("taken-name")
        for m in ("taken_ep", "taken_helper", "deco_core"):
            sys.modules.pop(m, None)
    (root / "taken_ep.py").write_text("import taken_helper\nraise ImportError('broken after its import')\n")
    try:  # an entry point that fails after such an import: broken, and the helper's class is not served
        with pytest.raises(SolverLoadError, match="broken after its import"):
            get_solver_class("taken-name")
    finally:
        registry.REGISTRY.unregister("taken-name")
        for m in ("taken_ep", "taken_helper"):
            sys.modules.pop(m, None)


SHADOW_DECLARED = '''
    from icl_bench import Solver

    class Declared(Solver):
        """The class the entry point declares."""
        params = {}

        def predict(self, batch):
            return batch.y.mean(dim=1)
'''


def test_a_non_solver_is_named_without_a_memory_address():
    """An entry point to a function was refused as '<function f at 0x7fbf...>', so the error rows of
    two identical runs differed in their message column (a plugin author's review)."""
    from icl_bench.solvers import registry

    def not_a_solver():
        return None

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    with pytest.raises(TypeError) as err:
        fresh.add("not-a-solver", not_a_solver, origin="built-in (__main__)")
    assert str(err.value) == (f"solver 'not-a-solver': function {__name__}.test_a_non_solver_is_named_without_a_memory_"
                              "address.<locals>.not_a_solver is not a subclass of icl_bench.Solver")


@pytest.mark.parametrize("name", ["ols\u00aa", "gd\u00ba", "\u00b5-solver", "\u2113" + "1-prox", "d\u02bcols",
                                  "gd\u306e\u6539\u826f", "\u03bf\u03bb\u03c2", "na\u00efve-gd"])
def test_names_with_letters_that_are_no_look_alike_are_accepted(name):
    """ª, º, µ, ℓ and ʼ were refused as 'letters of the FEMININE (MICRO, SCRIPT...) and LATIN scripts':
    the first word of a Unicode name is not always a script (a review). Only Latin mixed with a
    script of look-alike letters (Cyrillic, Greek, ...) is refused."""
    from icl_bench.solvers import registry

    class Fine(Solver):
        """Answers 0."""
        params = {}

        def predict(self, batch):
            return torch.zeros_like(batch.x_query)

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    fresh.add(name, Fine, origin="built-in (__main__)")
    assert fresh.origin(name) == "built-in (__main__)"


def test_a_parameter_name_that_is_no_config_key_is_refused():
    """A parameter is a key of [solvers.NAME]: 'my-shift' or 'two words' cannot be written as a bare
    TOML key there and no config could set it (only identifiers are accepted)."""
    from icl_bench import Param
    from icl_bench.solvers import registry

    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    for key in ("my-shift", "two words", ""):
        cls = type("Keyed", (Solver,), {"params": {key: Param(0.0, "x")}, "predict": lambda s, b: b.x_query})
        with pytest.raises(TypeError, match=re.escape(f"solver 'keyed': parameter name {key!r} must be an identifier")):
            fresh.add("keyed", cls, origin="built-in (__main__)")


def test_a_name_taken_by_another_class_is_refused_and_the_same_class_may_register_again():
    """Two notebook cells registering different classes as one name: the second was served in place
    of the first, silently. It is refused, naming where the first came from; re-running the cell
    that registered the class itself (the same class object) is fine."""
    from icl_bench.solvers import registry

    def solver_class():
        return type("Mine", (Solver,), {"params": {}, "predict": lambda s, b: b.x_query})

    first, second = solver_class(), solver_class()
    fresh = registry.Registry(registry.BUILTINS, registry.ENTRY_POINT_GROUP)
    fresh.add("twice-named", first, origin="built-in (notebook)")
    fresh.add("twice-named", first, origin="built-in (notebook)")
    with pytest.raises(ValueError, match=r"^solver 'twice-named': already registered by built-in \(notebook\)$"):
        fresh.add("twice-named", second, origin="built-in (other)")
    assert fresh.get_class("twice-named") is first


OWN_DECO = DECO_CORE.replace("deco-solver", "own-deco").replace("class Deco", "class Own")  # declared and decorated


def test_a_plugin_module_imported_directly_may_register_the_name_its_package_declares(tmp_path, monkeypatch):
    """A plugin whose module both declares an entry point and decorates its class: importing that
    module directly (a notebook, or another of the plugin's modules) registers the name from the
    package that declares it, which is no impostor."""
    import importlib

    from icl_bench.solvers import registry

    from conftest import write_plugin

    root = write_plugin(tmp_path / "site", "own-deco-plugin", {"own-deco": "own_deco_mod:Own"}, {"own_deco_mod": OWN_DECO})
    monkeypatch.syspath_prepend(str(root))
    try:
        module = importlib.import_module("own_deco_mod")
        assert get_solver_class("own-deco") is module.Own
    finally:
        registry.REGISTRY.unregister("own-deco")
        sys.modules.pop("own_deco_mod", None)


def test_a_folder_twice_on_sys_path_ranks_by_its_first_place(tmp_path, monkeypatch):
    """A clash between two distributions is decided by the first sys.path entry that holds each: a
    folder listed again later (PYTHONPATH and a .pth file naming it) keeps its first place."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    first = write_plugin(tmp_path / "first", "zzz-first", {"path-clash": "zzz_first:Shadow"}, {"zzz_first": SHADOW})
    second = write_plugin(tmp_path / "second", "aaa-second", {"path-clash": "aaa_second:Shadow"}, {"aaa_second": SHADOW})
    monkeypatch.setattr(sys, "path", [str(first), str(second), *sys.path, str(first)])
    assert registry.REGISTRY.entry_points()["path-clash"].value == "zzz_first:Shadow"
    assert [line for line in registry.conflicts() if "path-clash" in line] == [
        "plugin aaa_second:Shadow (aaa-second) declares 'path-clash', already declared by zzz_first:Shadow: ignored"]


def test_two_distributions_declaring_the_same_entry_point_are_no_conflict(tmp_path, monkeypatch):
    """The same name for the same module:Class from two distributions (a plugin installed under an
    old and a new name) loads one class either way: nothing is reported as ignored."""
    from icl_bench.solvers import registry

    from conftest import write_plugin

    site = tmp_path / "site"
    write_plugin(site, "oldname-plugin", {"same-clash": "same_mod:Shadow"}, {"same_mod": SHADOW})
    write_plugin(site, "newname-plugin", {"same-clash": "same_mod:Shadow"}, {})  # (names that differ before their '-')
    monkeypatch.syspath_prepend(str(site))
    assert registry.REGISTRY.entry_points()["same-clash"].value == "same_mod:Shadow"
    assert not [line for line in registry.conflicts() if "same-clash" in line]


def test_an_unknown_name_in_other_case_suggests_the_known_one():
    """difflib finds no match for 'OLS' ('ols' shares no letter in its case); the hint still names it."""
    with pytest.raises(UnknownSolverError, match=r"solver: unknown name 'OLS'; known: .*; did you mean 'ols'\?$"):
        get_solver("OLS")
