"""litespark-megatron: Llama-style pretraining on Megatron-Core with Litespark attention and MLP."""
__version__ = "0.1.0"

import logging as _logging
import warnings as _warnings

# A CUDA build of torch on a machine without a GPU (CI, a CPU laptop) logs "No CUDA runtime is found, using
# CUDA_HOME=..." on every import of its C++-extension module, which megatron-core and Transformer Engine import.
# Nothing is wrong on such a machine: the message is dropped there (it can never fire where a GPU is present).
_logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: "No CUDA runtime is found" not in record.getMessage())

# megatron-core warns, module by module as it is imported, that Transformer Engine and Apex are absent and which
# fallback it takes (with TE absent, also that TE "0.0.0" has no MoE experts): a screen of warnings on every rank
# before --help's usage line or a run's first line. The fallbacks are what such a machine runs; where a run needs TE,
# litespark-train refuses it in one line (arguments.check). It also calls its multimodal MimoModelConfig, which
# megatron.training imports and Litespark never builds, experimental. Set here, before any module of the package
# imports megatron-core; only these messages are dropped.
_warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed\.")
_warnings.filterwarnings("ignore", message=r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version "
                                           r"is 0\.0\.0\.")
_warnings.filterwarnings("ignore", message=r"MimoModelConfig is experimental")
# Some of megatron-core's docstrings hold invalid escape sequences, which Python's compiler reports (SyntaxWarning)
# when it byte-compiles them: at install time with pip, at the first run where an installer does not byte-compile
# (uv's default, pip --no-compile). Only warnings about megatron's own source files are dropped.
_warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]megatron[/\\]")
# Transformer Engine's package warns on import, wherever Jax is also installed (a common GPU image), that its Jax
# extension is missing: this package runs TE's PyTorch side only.
_warnings.filterwarnings("ignore", message=r"Detected a Jax installation but could not find the shared object file "
                                           r"for the Transformer Engine Jax extension")
