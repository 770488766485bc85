import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from icl_bench import Dist, PromptSpec, make_batch, sample_prompts
from icl_bench.prompts.ols import ols_predict


def test_shapes_dtypes_and_tokens():
    spec = PromptSpec(N=7, noise=0.1, R=50.0)
    b = sample_prompts(spec, 11, seed=3, dtype="float32")
    assert b.x.shape == b.y.shape == (11, 7)
    for name in ("x_query", "y_query", "y_query_clean", "slope", "intercept", "ols_prediction"):
        assert getattr(b, name).shape == (11,)
    assert b.tokens.shape == (11, 8, 3) and b.tokens.dtype == torch.float32
    assert b.ols_prediction.dtype == torch.float64
    assert torch.equal(b.tokens[:, :7, 0], b.x) and torch.equal(b.tokens[:, :7, 1], b.y)
    assert torch.equal(b.tokens[:, 7, 0], b.x_query)
    assert (b.tokens[:, 7, 1] == 0).all() and (b.tokens[..., 2] == 50.0).all()
    assert torch.allclose(b.y_query_clean, b.intercept + b.slope * b.x_query)


def test_noise_level_and_clean_data():
    b = sample_prompts(PromptSpec(N=50, noise=0.5), 4000, seed=0, dtype="float64")
    resid = b.y - (b.intercept[:, None] + b.slope[:, None] * b.x)
    assert abs(resid.std().item() - 0.5) < 0.01
    clean = sample_prompts(PromptSpec(N=50, noise=0.0), 100, seed=0, dtype="float64")
    assert torch.allclose(clean.ols_prediction, clean.y_query_clean.double(), atol=1e-10)


def test_each_field_is_drawn_from_its_own_distribution_and_the_query_noise_is_its_own():
    """Which distribution feeds which field, and that the query's noise is independent of the
    context's (a mutation review: drawing the intercept or the query from the slope's distribution,
    or reusing the last example's noise for the query, passed every test)."""
    spec = PromptSpec(N=5, noise=1.0, x=Dist("uniform", 10.0, 1.0), slope=Dist("normal", -3.0, 0.1),
                      intercept=Dist("normal", 7.0, 2.0))
    b = sample_prompts(spec, 20000, seed=1, dtype="float64")
    assert ((b.x >= 10) & (b.x <= 11)).all() and ((b.x_query >= 10) & (b.x_query <= 11)).all()
    assert abs(b.x_query.mean().item() - 10.5) < 0.01 and abs(b.x_query.std().item() - 12 ** -0.5) < 0.01
    assert abs(b.slope.mean().item() + 3.0) < 0.005 and abs(b.slope.std().item() - 0.1) < 0.005
    assert abs(b.intercept.mean().item() - 7.0) < 0.05 and abs(b.intercept.std().item() - 2.0) < 0.05
    noise = b.y - (b.intercept[:, None] + b.slope[:, None] * b.x)  # (B, N)
    query_noise = b.y_query - b.y_query_clean  # (B,)
    assert abs(query_noise.std().item() - 1.0) < 0.02
    for i in range(spec.N):  # independent of every context example's noise: |corr| ~ 1/sqrt(B) = 0.007
        assert abs(torch.corrcoef(torch.stack([noise[:, i], query_noise]))[0, 1].item()) < 0.03


def test_seeds_in_torchs_whole_range_are_accepted():
    """The documented range [-2**63, 2**64) holds at both ends (only the outside was tested)."""
    for seed in (-2**63, 2**63, 2**64 - 1):
        assert sample_prompts(PromptSpec(N=3), 2, seed=seed, dtype="float64").x.shape == (2, 3)
    with pytest.raises(ValueError, match=r"^seed: must be an integer in \[-2\*\*63, 2\*\*64\)"):
        sample_prompts(PromptSpec(N=3), 2, seed=2**64, dtype="float64")


def test_same_seed_same_tensors_other_seed_differs():
    spec = PromptSpec(N=9, noise=0.2, R=10.0, x=Dist("uniform", -1.0, 2.0))
    a, b = (sample_prompts(spec, 32, seed=5) for _ in range(2))
    for k, v in a.tensors().items():
        assert torch.equal(v, getattr(b, k)), k
    assert not torch.equal(a.x, sample_prompts(spec, 32, seed=6).x)


def test_same_seed_same_tensors_across_processes():
    code = ("import torch;from icl_bench import PromptSpec,sample_prompts;"
            "b=sample_prompts(PromptSpec(N=6,noise=0.1),8,seed=42,dtype='float64');print(b.tokens.sum().item().hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)}
    here = sample_prompts(PromptSpec(N=6, noise=0.1), 8, seed=42, dtype="float64").tokens.sum().item().hex()
    assert outs == {here + "\n"}


def test_a_seed_draws_its_fields_in_a_fixed_order():
    """A spec and seed name their prompts (the committed results and a cell's key give the seed,
    not the values): slope (B), intercept (B), x (B, N), the query (B), then the noise (B, N + 1),
    from one generator in that order. (A mutation review: drawing the intercept before the slope,
    or taking the query from x's first column, passed every test: same distributions.)"""
    spec = PromptSpec(N=4, noise=0.5, x=Dist("uniform", -1.0, 2.0), slope=Dist("normal", 2.0, 3.0),
                      intercept=Dist("normal", -1.0, 0.5))
    b = sample_prompts(spec, 3, seed=17, dtype="float64")
    g = torch.Generator().manual_seed(17)
    slope = 2.0 + 3.0 * torch.randn((3,), generator=g, dtype=torch.float64)
    intercept = -1.0 + 0.5 * torch.randn((3,), generator=g, dtype=torch.float64)
    x = -1.0 + 2.0 * torch.rand((3, 4), generator=g, dtype=torch.float64)
    u = -1.0 + 2.0 * torch.rand((3,), generator=g, dtype=torch.float64)
    eps = 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    assert torch.equal(b.slope, slope) and torch.equal(b.intercept, intercept)
    assert torch.equal(b.x, x) and torch.equal(b.x_query, u)
    assert torch.equal(b.y, intercept[:, None] + slope[:, None] * x + eps[:, :4])
    assert torch.equal(b.y_query, intercept + slope * u + eps[:, 4])


def test_float32_and_float64_share_prompts_and_reference_is_float64_of_cast_values():
    spec = PromptSpec(N=20, noise=0.1)
    b32 = sample_prompts(spec, 16, seed=1, dtype="float32")
    b64 = sample_prompts(spec, 16, seed=1, dtype="float64")
    assert torch.equal(b32.x, b64.x.float())
    ref = ols_predict(b32.x.double(), b32.y.double(), b32.x_query.double())
    assert torch.equal(b32.ols_prediction, ref)


def test_uniform_distribution_range():
    b = sample_prompts(PromptSpec(N=100, x=Dist("uniform", 2.0, 3.0)), 50, seed=0)
    assert b.x.min() >= 2.0 and b.x.max() <= 5.0


def test_a_scale_of_zero_fixes_the_value():
    """Dist takes scale >= 0 (docs/design.md): scale 0 draws loc itself, e.g. a fixed slope
    (a mutation review: refusing scale 0 passed every test)."""
    spec = PromptSpec(N=3, slope=Dist("normal", 2.0, 0.0), intercept=Dist("uniform", -1.5, 0.0))
    b = sample_prompts(spec, 5, seed=0, dtype="float64")
    assert b.slope.tolist() == [2.0] * 5 and b.intercept.tolist() == [-1.5] * 5


def test_make_batch_single_prompt_and_batch():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    y = 1.0 + 2.0 * x
    b = make_batch(x, y, 10.0, R=100.0)
    assert b.tokens.shape == (1, 5, 3)
    assert torch.allclose(b.ols_prediction, torch.tensor([21.0], dtype=torch.float64))
    assert torch.isnan(b.y_query_clean).all()
    bb = make_batch(torch.stack([x, x]), torch.stack([y, -y]), [1.0, 1.0], R=10.0, dtype="float32")
    assert torch.allclose(bb.ols_prediction, torch.tensor([3.0, -3.0], dtype=torch.float64))


def test_zero_spread_gives_nan_reference():
    b = make_batch([0.1, 0.1, 0.1], [1.0, 2.0, 3.0], 0.5, R=10.0)
    assert torch.isnan(b.ols_prediction).all()


@pytest.mark.parametrize("kwargs, field", [
    (dict(N=1), "N"), (dict(N=3.0), "N"), (dict(noise=-0.1), "noise"), (dict(R=0.0), "R"),
    (dict(R=float("inf")), "R"), (dict(noise=float("nan")), "noise"),
    (dict(noise="0.1"), "noise"), (dict(R="100"), "R"), (dict(noise=True), "noise"), (dict(N=True), "N"),
    (dict(x={"dist": "normal", "loc": 0.0, "scale": 1.0}), "x"), (dict(slope=("normal", 0, 1)), "slope"),
])
def test_bad_spec_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        PromptSpec(**kwargs)


def test_bad_make_batch_inputs():
    for R in (0.0, -1.0, float("inf"), float("nan")):  # the R of a batch made from the user's arrays
        with pytest.raises(ValueError, match=r"^R: must be finite and > 0"):
            make_batch([[1.0, 2.0]], [[1.0, 2.0]], 0.0, R=R)
    with pytest.raises(ValueError, match="^x, y:"):
        make_batch([[1.0, 2.0]], [1.0, 2.0, 3.0], 0.0, R=1.0)
    with pytest.raises(ValueError, match="^N:"):
        make_batch([1.0], [1.0], 0.0, R=1.0)
    with pytest.raises(ValueError, match="^x_query:"):
        make_batch([[1.0, 2.0]], [[1.0, 2.0]], [0.0, 1.0], R=1.0)
    with pytest.raises(ValueError, match="^dtype:"):
        sample_prompts(PromptSpec(), 2, seed=0, dtype="float16")
    with pytest.raises(ValueError, match="^dist:"):
        Dist("cauchy")


def test_numpy_and_tensor_scalars_are_numbers_and_bad_api_arguments_name_their_field():
    """np.int64(10) read "N: must be an integer >= 2 (got np.int64(10))"; a float seed was truncated
    silently, 2**70 overflowed inside torch, "cuda" without a GPU was torch's AssertionError, a
    y_query of the wrong length failed later in the metrics (a review of the Python API)."""

    spec = PromptSpec(N=np.int64(10), R=torch.tensor(100.0), noise=np.float32(0.5))
    assert (type(spec.N), spec.N, spec.R, spec.noise) == (int, 10, 100.0, 0.5)
    assert spec == PromptSpec(N=10, R=100.0, noise=0.5) and hash(spec) == hash(PromptSpec(N=10, R=100.0, noise=0.5))
    same = sample_prompts(spec, np.int64(4), seed=np.int64(3))
    assert torch.equal(same.x, sample_prompts(PromptSpec(N=10, R=100.0, noise=0.5), 4, seed=3).x)
    for seed in (1.5, 2**70, -2**63 - 1, "3", True):
        with pytest.raises(ValueError, match=re.escape("seed: must be an integer in [-2**63, 2**64) (got ")):
            sample_prompts(PromptSpec(), 2, seed=seed)
    for seed in (-1, torch.tensor(3), np.array(3)):  # what torch's manual_seed takes (a review: these had worked)
        assert sample_prompts(PromptSpec(), 2, seed=seed).B == 2
    assert PromptSpec(R=np.array(100.0)).R == 100.0
    with pytest.raises(ValueError, match="^R: an integer of 1329 bits is beyond float64's range"):
        PromptSpec(R=10**400)
    with pytest.raises(ValueError, match=re.escape("seed: must be an integer in [-2**63, 2**64) (got an integer of 16610")):
        sample_prompts(PromptSpec(), 2, seed=10**5000)  # (its repr alone raised Python's int-to-str limit)
    assert sample_prompts(PromptSpec(), 2, seed=0, device=None).x.device.type == "cpu"
    with pytest.raises(ValueError, match="^device: 'meta'; accepted: cpu, cuda, cuda:N"):
        sample_prompts(PromptSpec(), 2, seed=0, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device: 'cuda' is not available on this machine"):
            make_batch([[1.0, 2.0]], [[1.0, 2.0]], 0.0, R=1.0, device="cuda")
    with pytest.raises(ValueError, match=re.escape("y_query: must have shape (2,) or be a scalar (got (3,))")):
        make_batch([[1.0, 2.0]] * 2, [[1.0, 2.0]] * 2, 0.0, R=1.0, y_query=[1.0, 2.0, 3.0])
    assert make_batch([[1.0, 2.0]] * 2, [[1.0, 2.0]] * 2, 0.0, R=1.0, y_query=7.0).y_query.tolist() == [7.0, 7.0]
    with pytest.raises(ValueError, match="^R: must be a real number"):
        make_batch([[1.0, 2.0]], [[1.0, 2.0]], 0.0, R="1")


def test_dtype_batch_size_seed_message_and_to_edges():
    """A torch dtype other than float32 / float64 is refused like its name (torch.float16 and
    torch.int64 were taken: resolve_dtype checked the type only); n_prompts refuses a bool as N
    does; a seed up to 256 bits is shown as written; PromptBatch.to returns the batch itself
    where it already is (its docstring). Each was a surviving mutation of a review."""
    for dt in (torch.float16, torch.bfloat16, torch.int64):
        with pytest.raises(ValueError, match="^dtype: unknown dtype"):
            sample_prompts(PromptSpec(N=3), 2, seed=0, dtype=dt)
    assert sample_prompts(PromptSpec(N=3), 2, seed=0, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match=re.escape("n_prompts: must be an integer >= 1 (got True)")):
        sample_prompts(PromptSpec(N=3), True, seed=0)
    with pytest.raises(ValueError, match=re.escape("(got 1180591620717411303424)")):
        sample_prompts(PromptSpec(N=3), 2, seed=2**70)
    b = sample_prompts(PromptSpec(N=3), 2, seed=0)
    assert b.to("cpu") is b and b.to(torch.device("cpu")) is b


def test_the_multivariate_generator_checks_its_arguments_as_the_univariate_one():
    """np.int64 n_prompts or d were refused at d > 1 only, and "cuda" / "meta" failed inside torch."""
    import numpy as np

    from icl_bench.prompts.multivariate import make_batch_mv, sample_prompts_mv

    assert sample_prompts_mv(PromptSpec(), np.int64(4), d=np.int64(2), seed=0).x.shape == (4, 20, 2)
    from fractions import Fraction

    same = sample_prompts_mv(PromptSpec(), 4, d=torch.tensor(2), x_corr=Fraction(1, 2), seed=0)  # (Fraction failed
    assert torch.equal(same.x, sample_prompts_mv(PromptSpec(), 4, d=2, x_corr=0.5, seed=0).x)  # inside torch)
    with pytest.raises(ValueError, match="^device: 'meta'; accepted: cpu, cuda, cuda:N"):
        sample_prompts_mv(PromptSpec(), 4, d=2, seed=0, device="meta")
    with pytest.raises(ValueError, match="^n_prompts: must be an integer >= 1"):
        sample_prompts_mv(PromptSpec(), 0, d=2, seed=0)
    with pytest.raises(ValueError, match=re.escape("d: must be an integer in [1, 64] (got 'a')")):  # (it said None)
        sample_prompts_mv(PromptSpec(), 4, d="a", seed=0)
    with pytest.raises(ValueError, match="^R: must be a real number"):
        make_batch_mv(torch.randn(2, 5, 2), torch.randn(2, 5), torch.randn(2, 2), R="1")


def test_run_matrix_and_load_config_name_what_they_take():
    from icl_bench.bench.config import load_config
    from icl_bench.bench.runner import run_matrix
    from icl_bench.errors import ConfigError

    with pytest.raises(TypeError, match=r"^config: run_matrix takes a MatrixConfig \(got dict\); build one with"):
        run_matrix({"grid": {"N": [4]}})
    assert load_config("default").grid.N == load_config("default.toml").grid.N  # a packaged name, as --config takes
    with pytest.raises(ConfigError, match="^config: no such file 'nope'; packaged configs: default"):
        load_config("nope")
    with pytest.raises(ConfigError, match=re.escape("config: 'train' is a training config; run it with `icl-bench "
                                                    "train --config train`")):
        load_config("train")


def test_dist_takes_real_numbers_and_make_batch_queries_take_their_documented_shapes():
    """Dist's loc and scale are numbers as PromptSpec's are: a bool or str is refused naming them,
    an int of 400 digits too (OverflowError from math.isfinite), a tensor or numpy scalar becomes
    a float (equal specs hash equal). make_batch's x_query and y_query are (B,) or a scalar: a
    (2, 2) array for 4 prompts was flattened silently."""
    for loc, scale, what in ((True, 1.0, "loc: must be a real number (got bool True)"),
                             (0.0, "1", "scale: must be a real number (got str '1')"),
                             (0.0, 10**400, "scale: an integer of 1329 bits is beyond float64's range")):
        with pytest.raises(ValueError, match=re.escape(f"dist: {what}")):
            Dist("normal", loc, scale)
    d = Dist("uniform", torch.tensor(2.0), np.float32(0.5))
    assert (type(d.loc), type(d.scale), hash(d)) == (float, float, hash(Dist("uniform", 2.0, 0.5)))
    x = [[0.0, 1.0, 2.0]] * 4
    with pytest.raises(ValueError, match=re.escape("x_query: must have shape (4,) or be a scalar (got (2, 2))")):
        make_batch(x, x, [[1.0, 2.0], [3.0, 4.0]], R=10.0)
    with pytest.raises(ValueError, match=re.escape("y_query: must have shape (4,) or be a scalar (got (2, 2))")):
        make_batch(x, x, 0.0, R=10.0, y_query=[[1.0, 2.0], [3.0, 4.0]])
