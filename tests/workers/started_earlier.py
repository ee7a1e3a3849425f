"""litespark-train whose rank $EARLIER_RANK believes it started $EARLIER_SECONDS seconds earlier: megatron.training
measures --exit-duration-in-mins from the program's start, so that rank reaches the limit first."""
import os
import sys

from litespark_megatron import pretrain

if os.environ.get("RANK", "0") == os.environ["EARLIER_RANK"]:
    pretrain._PROGRAM_START_TIME -= float(os.environ["EARLIER_SECONDS"])  # handed to megatron.training as its start

if __name__ == "__main__":
    sys.exit(pretrain.main())
