"""litespark-megatron: Llama-style pretraining on Megatron-Core with Litespark attention and MLP."""
__version__ = "0.1.0"

import logging as _logging

# A CUDA build of torch on a machine without a GPU (CI, a CPU laptop) logs "No CUDA runtime is found, using
# CUDA_HOME=..." on every import of its C++-extension module, which megatron-core and Transformer Engine import.
# Nothing is wrong on such a machine: the message is dropped there (it can never fire where a GPU is present).
_logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: "No CUDA runtime is found" not in record.getMessage())
