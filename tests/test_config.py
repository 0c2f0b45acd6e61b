"""Config validation: data only, every entry checked, messages name the entry."""

from __future__ import annotations

import pytest

from curvgap.derivations.config import ConfigError, load, validate


def test_defaults_are_the_papers_block():
    config = validate({"name": "x"}.copy() | {"kind": "layernorm"})
    assert (config.norm, config.eps, config.affine, config.loss) == ("layernorm", 0.0, False, "mse")


@pytest.mark.parametrize("name", ["1abc", "a-b", "class", "a b", "ünï", ""])
def test_name_must_be_a_python_identifier(name):
    with pytest.raises(ConfigError, match="'name' must be a Python identifier.*" + repr(name)[1:-1]):
        validate({"name": name, "kind": "layernorm"})


def test_unknown_key_lists_the_allowed_keys():
    with pytest.raises(ConfigError, match="unknown key 'epsilon'; allowed keys: name, kind, norm"):
        validate({"name": "a", "kind": "layernorm", "epsilon": 1e-5})


@pytest.mark.parametrize("key, value, allowed", [
    ("kind", "conv", "block, self_attention, layernorm, ffn"),
    ("norm", "batchnorm", "layernorm, rmsnorm"),
    ("activation", "swish", "relu, gelu, gelu_tanh"),
    ("loss", "l1", "mse, cross_entropy"),
])
def test_unknown_value_lists_the_choices(key, value, allowed):
    with pytest.raises(ConfigError, match=f"'{key}' must be one of {allowed}.*got '{value}'"):
        validate({"name": "a", "kind": "layernorm", key: value})


@pytest.mark.parametrize("key, value", [("eps", "0.1"), ("affine", 1), ("heads", 2.0),
                                        ("heads", True), ("name", 3)])
def test_wrong_types(key, value):
    with pytest.raises(ConfigError, match=f"'{key}' must be a"):
        validate({"name": "a", "kind": "layernorm", key: value} if key != "name"
                 else {"name": value})


def test_negative_eps():
    with pytest.raises(ConfigError, match="'eps' must be a finite number >= 0, got -1.0"):
        validate({"name": "a", "kind": "layernorm", "eps": -1.0})


def test_option_that_does_not_apply_to_the_kind():
    with pytest.raises(ConfigError, match="'heads' applies to kind block or self_attention, "
                                          "not to kind 'layernorm'"):
        validate({"name": "a", "kind": "layernorm", "heads": 2})


def test_heads_without_output_projection_is_rejected_with_a_reason():
    with pytest.raises(ConfigError, match="heads = 2 needs out_proj = true: concatenating "
                                          "heads without W_O is not derived yet"):
        validate({"name": "a", "kind": "block", "heads": 2})


def test_registered_residual_loss_becomes_a_valid_choice():
    import sympy as sp

    from curvgap.derivations.losses import r, register_residual_loss

    with pytest.raises(ConfigError, match="'loss' must be one of mse, cross_entropy"):
        validate({"name": "a", "kind": "ffn", "loss": "log_cosh_test"})
    register_residual_loss("log_cosh_test", sp.log(sp.cosh(r)))
    assert validate({"name": "a", "kind": "ffn", "loss": "log_cosh_test"}).loss == "log_cosh_test"
    with pytest.raises(ValueError, match="expected an expression of the residual r alone"):
        register_residual_loss("bad_loss", sp.Symbol("z") * r)


def test_toml_is_parsed_as_data(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('name = "__import__(\'os\')"\nkind = "layernorm"\n')
    with pytest.raises(ConfigError, match="must be a Python identifier"):
        load(path)
    path.write_text("name = [unclosed\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(path)
    with pytest.raises(ConfigError, match="no such file"):
        load(tmp_path / "missing.toml")
