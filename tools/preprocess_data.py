#!/usr/bin/env python3
"""Tokenize text into a megatron-core indexed dataset (PREFIX.bin + PREFIX.idx).

Same output format as Megatron-LM's tools/preprocess_data.py. Examples:

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs --train-tokenizer-vocab-size 32000
    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/docs \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model path/to/tokenizer_dir

The work is done by litespark_megatron.corpus (also installed as the `litespark-preprocess` command).
"""
import os
import sys

try:
    from litespark_megatron.corpus import preprocess_main
except ImportError:
    # Run from a source checkout without installing: the package is in the parent directory of tools/.
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
    from litespark_megatron.corpus import preprocess_main


def main(argv=None) -> int:
    return preprocess_main(argv, prog="preprocess_data.py")


if __name__ == "__main__":
    sys.exit(main())
