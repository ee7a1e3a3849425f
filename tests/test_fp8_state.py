"""FP8 runs resume (platform/fp8_state.py): Transformer Engine's delayed-scaling state, which TE 2.18+ saves as a
pickle and refuses to unpickle, is loaded when the pickle holds nothing but that state (tensors, TE's recipe classes,
plain values) and refused otherwise. On the CPU the allowlist, with a stand-in for TE's recipe module; on a GPU a
real FP8 run stopped and resumed equals the uninterrupted one, bit for bit."""
import enum
import os
import pickle
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from conftest import child_env, free_port, losses, ok, train
from litespark_megatron.platform import fp8_state

RECIPE = "transformer_engine.common.recipe"


@pytest.fixture
def recipe_module(monkeypatch):
    """TE's recipe module as far as pickle can tell: a dataclass recipe holding an enum (TE's DelayedScaling and
    Format), and a function beside them."""
    module = types.ModuleType(RECIPE)

    class Format(enum.Enum):
        HYBRID = (448, 57344)

    @dataclass
    class DelayedScaling:
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    def helper():
        return "ran"

    for obj in (Format, DelayedScaling, helper):
        obj.__module__, obj.__qualname__ = RECIPE, obj.__name__
        setattr(module, obj.__name__, obj)
    for name in ("transformer_engine", "transformer_engine.common"):  # (None where imports of TE are blocked)
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, RECIPE, module)
    return module


def scaling_state(recipe_module, **extra):
    """What TE's get_extra_state holds for a delayed-scaling module."""
    state = {"recipe": recipe_module.DelayedScaling(), "scale_fwd": torch.rand(3), "amax_history_fwd": torch.rand(8, 3),
             "scale_bwd": torch.rand(2), "amax_history_bwd": torch.rand(8, 2),
             "extra_fp8_variables": {"num_gemms": 1, "fp8_max_fwd": 448.0}}
    state.update(extra)
    return state


def te_state(recipe_module, **extra):
    """... as TE pickles it."""
    return pickle.dumps(scaling_state(recipe_module, **extra))


def test_the_scaling_state_passes_and_unpickles_as_saved(recipe_module):
    state = scaling_state(recipe_module)
    data = pickle.dumps(state)
    assert fp8_state.is_scaling_state(data)
    loaded = pickle.loads(data)  # what TE then loads: the stand-in recipe and the tensors as they were saved
    assert loaded["recipe"] == state["recipe"] and loaded["recipe"].fp8_format is recipe_module.Format.HYBRID
    assert all(torch.equal(loaded[key], state[key]) for key in ("scale_fwd", "amax_history_fwd", "scale_bwd",
                                                                 "amax_history_bwd"))


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("extra", [{"payload": _Runs()}, {"hook": "function"}], ids=["os.system", "recipe function"])
def test_a_pickle_that_would_call_anything_else_is_refused(recipe_module, extra):
    if "hook" in extra:
        extra = {"hook": recipe_module.helper}  # a function of the recipe module, not one of its classes
    assert not fp8_state.is_scaling_state(te_state(recipe_module, **extra))


def test_the_reader_takes_tes_answer_and_checks_only_what_te_refuses(recipe_module):
    """TE's decision stands where it decides (ignore an empty payload; load where its variable allows it); where it
    refuses, a payload of scaling state alone is loaded and any other keeps TE's refusal."""
    def refuses(data, context):
        raise RuntimeError(f"Refusing to load pickled Transformer Engine extra state for {context}")

    checked = fp8_state._checked(refuses)
    assert checked(te_state(recipe_module), "TELinear") is True
    with pytest.raises(RuntimeError, match="Refusing to load pickled Transformer Engine extra state for TELinear"):
        checked(te_state(recipe_module, payload=_Runs()), "TELinear")
    assert fp8_state._checked(lambda data, context: False)(te_state(recipe_module, payload=_Runs()), "x") is False


@pytest.mark.gpu
def test_both_of_tes_readers_take_the_check():
    """Fails when Transformer Engine moves or renames what its modules and fusible ops call to decide."""
    pytest.importorskip("transformer_engine.pytorch")
    import importlib

    fp8_state.load_fp8_scaling_state()
    for reader in fp8_state.READERS:
        module = importlib.import_module(f"transformer_engine.pytorch.{reader}")
        assert getattr(module.should_load_extra_state_pickle, "litespark_checked", False), reader


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 runs on a GPU with FP8 tensor cores")
def test_an_fp8_delayed_scaling_run_resumes_bit_exactly(tmp_path):
    """--fp8-recipe delayed (Megatron-LM's default): stopped at step 3 and resumed, the run equals the run without the
    stop. Before the fix the resume stopped at load with TE's pickle refusal."""
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or more")
    run = ["--model", "tiny", "--mock-data", "--seq-length", "128", "--global-batch-size", "8", "--micro-batch-size",
           "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "6", "--log-interval", "1", "--eval-iters",
           "0", "--eval-interval", "100", "--seed", "7", "--save-interval", "100", "--bf16", "--fp8-format", "hybrid",
           "--fp8-recipe", "delayed", "--spec", "litespark", "--transformer-impl", "transformer_engine"]
    def env():  # TE's own opt-in off, whatever the machine says
        return child_env(MASTER_PORT=free_port(), NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE="0")

    straight, halves = tmp_path / "straight", tmp_path / "halves"
    ok(train(1, *run, "--save", straight, env=env()))
    ok(train(1, *run, "--save", halves, "--load", halves, "--exit-interval", "3", env=env()))
    resumed = ok(train(1, *run, "--save", halves, "--load", halves, env=env()))
    assert "successfully loaded checkpoint" in resumed.stdout
    a, b = losses(straight / "metrics.jsonl"), losses(halves / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)], (a, b)
