"""The test suite's CPU pass (tests/conftest.py) puts this folder first on every child's Python path. With
LITESPARK_TEST_NO_TE=1, Transformer Engine does not import, as on a machine without a GPU: megatron-core takes TE
wherever it imports, GPU or not, and a CPU run would then reach TE's CUDA kernels.

As on a machine without it: `import transformer_engine` raises ModuleNotFoundError and
`importlib.util.find_spec("transformer_engine")` is None (None in sys.modules does both; libraries such as HF peft
ask find_spec before they import). The finder stays behind it, for a module that takes the entry out again."""
import os
import sys

HIDDEN = ("transformer_engine", "transformer_engine_torch")


class HideTransformerEngine:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named '{name}' (the test suite's CPU pass hides it)", name=name)
        return None


if os.environ.get("LITESPARK_TEST_NO_TE") == "1" and not any(
        type(finder).__name__ == "HideTransformerEngine" for finder in sys.meta_path):
    sys.meta_path.insert(0, HideTransformerEngine())
    for _name in HIDDEN:
        sys.modules.setdefault(_name, None)
