"""`python -m litespark_megatron` is `litespark-train`."""
import sys

from litespark_megatron.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
