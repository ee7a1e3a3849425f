#!/usr/bin/env python3
"""Hugging Face Llama checkpoints in and out of Megatron-LM's format. Examples:

    python tools/convert_checkpoint.py import path/to/Llama-3.2-1B ckpt/llama-3.2-1b
    python tools/convert_checkpoint.py export ckpt/my-run hf/my-run --dtype bf16

The work is done by litespark_megatron.hf_convert (also installed as the `litespark-convert` command).
"""
import os
import sys

try:
    from litespark_megatron.hf_convert import main
except ImportError:
    # Run from a source checkout without installing: the package is in the parent directory of tools/.
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
    from litespark_megatron.hf_convert import main

if __name__ == "__main__":
    sys.exit(main())
