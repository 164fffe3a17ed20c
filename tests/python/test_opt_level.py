import pytest
import torch

import optamp


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_parse_round_trip(level):
    assert optamp.parse_opt_level(level).name == level
    assert optamp.resolve(level).opt_level == level


@pytest.mark.parametrize("bad", ["00", "o1", "O6", "", "O1 ", "1"])
def test_parse_rejects_lookalikes(bad):
    with pytest.raises(ValueError, match="capital letter O"):
        optamp.parse_opt_level(bad)
    with pytest.raises(ValueError, match="capital letter O"):
        optamp.resolve(bad)


def test_opt_level_enum_accepted():
    assert optamp.resolve(optamp.OptLevel.O2).opt_level == "O2"


@pytest.mark.parametrize(
    "level,cast,patch,patch_type,keep_bn,master,loss_scale,low",
    [
        ("O0", torch.float32, False, None, None, False, 1.0, None),
        ("O1", None, True, torch.float16, None, None, "dynamic", torch.float16),
        ("O2", torch.float16, False, None, True, True, "dynamic", torch.float16),
        ("O3", torch.float16, False, None, False, False, 1.0, torch.float16),
        ("O4", None, True, torch.bfloat16, None, None, 1.0, torch.bfloat16),
        ("O5", torch.bfloat16, False, None, True, True, 1.0, torch.bfloat16),
    ],
)
def test_level_defaults(level, cast, patch, patch_type, keep_bn, master, loss_scale, low):
    p = optamp.resolve(level)
    assert p.enabled is True
    assert p.cast_model_type == cast
    assert p.patch_torch_functions is patch
    assert p.patch_torch_functions_type == patch_type
    assert p.keep_batchnorm_fp32 == keep_bn
    assert p.master_weights == master
    assert p.loss_scale == loss_scale
    assert p.low_dtype == low
    assert (p.num_losses, p.min_loss_scale, p.max_loss_scale) == (1, None, 2.0**24)
    assert (p.init_scale, p.growth_factor, p.backoff_factor) == (2.0**16, 2.0, 0.5)
    assert (p.growth_interval, p.hysteresis, p.verbosity) == (2000, 1, 1)


def test_none_means_not_overridden():
    p = optamp.resolve("O2", keep_batchnorm_fp32=None, loss_scale=None)
    assert p.keep_batchnorm_fp32 is True and p.loss_scale == "dynamic"


@pytest.mark.parametrize("level, low", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_patch_type_none_is_not_an_override(level, low):
    """Opt-level rule 9 (patching needs a type) is C++-only: from Python, None means "not
    overridden", so the level's own type stays, even with patch_torch_functions=True spelled out."""
    for overrides in ({}, {"patch_torch_functions": True}):
        props = optamp.resolve(level, patch_torch_functions_type=None, **overrides)
        assert props.patch_torch_functions is True
        assert props.patch_torch_functions_type == low
        overrides_line = next(line for line in props.describe().splitlines()
                              if line.startswith("Overrides applied"))
        assert "patch_torch_functions_type" not in overrides_line, overrides_line


def test_overrides_apply():
    p = optamp.resolve("O2", loss_scale=128, keep_batchnorm_fp32="False", growth_interval=7)
    assert p.loss_scale == 128.0 and p.keep_batchnorm_fp32 is False and p.growth_interval == 7
    assert "loss_scale=128" in p.describe()


@pytest.mark.parametrize(
    "level,kwargs,message",
    [
        ("O1", dict(cast_model_type=torch.float16), "cast_model_type"),
        ("O2", dict(patch_torch_functions=True), "patch_torch_functions=True"),
        ("O1", dict(keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
        ("O1", dict(master_weights=True), "master_weights"),
        ("O1", dict(loss_scale=-1.0), "loss_scale"),
        ("O1", dict(loss_scale="dynamc"), "loss_scale"),
        ("O1", dict(min_loss_scale=8.0, max_loss_scale=4.0), "min_loss_scale"),
        ("O1", dict(num_losses=0), "num_losses"),
        ("O1", dict(verbosity=5), "verbosity"),
        ("O5", dict(cast_model_type=torch.float16), "bfloat16 level"),
        ("O4", dict(patch_torch_functions_type=torch.float16), "bfloat16 level"),
        ("O1", dict(growth_factor=0.5), "growth_factor"),
        ("O1", dict(backoff_factor=2.0), "backoff_factor"),
        ("O1", dict(keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32"),
        ("O2", dict(patch_torch_functions_type=torch.bfloat16), "patch_torch_functions_type"),
        ("O2", dict(cast_model_type=torch.int32), "or None, got torch.int32$"),  # not torch.Int
    ],
)
def test_validation_errors_are_value_errors_with_cxx_text(level, kwargs, message):
    with pytest.raises(ValueError, match=message):
        optamp.resolve(level, **kwargs)


def test_type_errors():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        optamp.resolve("O1", bogus=1)
    with pytest.raises(TypeError, match="cast_model_type must be a torch.dtype"):
        optamp.resolve("O2", cast_model_type="half")
    with pytest.raises(TypeError, match="opt_level must be a str"):
        optamp.resolve(1)
    for name in ("num_losses", "verbosity", "growth_interval", "hysteresis"):
        with pytest.raises(TypeError, match=f"{name} must be an int, got float"):
            optamp.resolve("O1", **{name: 1.5})
    for name in ("init_scale", "growth_factor", "backoff_factor", "min_loss_scale",
                 "max_loss_scale", "loss_scale"):
        with pytest.raises(TypeError, match=f"{name} must be a number, got list"):
            optamp.resolve("O1", **{name: [2.0]})
    with pytest.raises(TypeError, match=r"enabled must be True, False, .* got a float"):
        optamp.resolve("O1", enabled=1.0)


def test_describe_mentions_defaults_and_final_options():
    text = optamp.resolve("O1", loss_scale=64.0).describe()
    assert "Selected optimization level O1" in text
    assert "Defaults for this optimization level are:" in text
    assert "After processing overrides, optimization options are:" in text
    assert "loss_scale                 : 64.0\n" in text
    assert "max_loss_scale             : 16777216.0" in text
