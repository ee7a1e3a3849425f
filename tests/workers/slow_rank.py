"""litespark-train whose rank $SLOW_RANK reads each micro-batch $SLOW_SECONDS late, as a rank with a slow data
loader or host would."""
import os
import sys
import time

from litespark_megatron import pretrain

_get_batch = pretrain.get_batch


def get_batch(*args, **kwargs):
    if os.environ.get("RANK", "0") == os.environ["SLOW_RANK"]:
        time.sleep(float(os.environ["SLOW_SECONDS"]))
    return _get_batch(*args, **kwargs)


pretrain.get_batch = get_batch  # forward_step reads the module's get_batch

if __name__ == "__main__":
    sys.exit(pretrain.main())
