"""Transformer Engine's FP8 delayed-scaling state, loaded back on resume where its pickle holds nothing else.

The gap: TE (2.18 and later; 2.20.2 here) saves each FP8 module's delayed-scaling state (its scales and amax
histories, what lets a resumed FP8 run continue as the uninterrupted one) as a Python pickle in the checkpoint's
`_extra_state`, and refuses to unpickle it unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1, because a pickle can run
any code. So every resume of an FP8 run under Megatron-LM's default recipe (--fp8-recipe delayed) stopped while
loading, with TE's advisory as a traceback. Setting the variable would trust every pickle of every checkpoint; the
rest of a torch_dist checkpoint is read with torch's weights-only unpickler.

The fix: a payload is unpickled first with megatron-core's own allowlist for this state (megatron.core.safe_globals.
SafeUnpickler, which megatron-core 0.19.2 uses for its grouped linears' extra state only: tensors through torch's
weights-only loader, TE's recipe classes, plain Python values). A payload that needs nothing else is handed to TE's
loader; any other keeps TE's own refusal and advice. TE's two readers of the state (its modules and its fusible
ops) take the check through the function they call to decide.
"""
from __future__ import annotations

import io

# What TE's module and op classes call to decide whether to unpickle a payload (transformer_engine.pytorch ...).
READERS = ("module.base", "ops.op")


def is_scaling_state(data: bytes) -> bool:
    """Whether a pickled `_extra_state` payload unpickles with megatron-core's allowlist (and so runs nothing else)."""
    from megatron.core.safe_globals import SafeUnpickler

    try:
        SafeUnpickler(io.BytesIO(data)).load()
    except Exception:
        return False
    return True


def load_fp8_scaling_state() -> None:
    """Let TE load a delayed-scaling payload that `is_scaling_state`; TE's own decision for every other one. A TE
    without the decision function (older, or changed) is left as it is: tests/test_fp8_state.py says so on a GPU."""
    import importlib

    for reader in READERS:
        module = importlib.import_module(f"transformer_engine.pytorch.{reader}")
        decide = getattr(module, "should_load_extra_state_pickle", None)
        if decide is None or getattr(decide, "litespark_checked", False):
            continue
        module.should_load_extra_state_pickle = _checked(decide)


def _checked(decide):
    def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
        try:
            return decide(data, context)
        except RuntimeError:  # TE's refusal of a payload it would have to unpickle
            if is_scaling_state(data):
                return True
            raise

    should_load_extra_state_pickle.litespark_checked = True
    return should_load_extra_state_pickle
