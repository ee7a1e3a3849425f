"""litespark-train whose step $HANG_AT_STEP never finishes on rank $HANG_RANK (default 0), as a rank stuck in I/O or
a bad node would: its forward sleeps for an hour. With HANG_KILL=1 the rank is SIGKILLed there instead, as an OOM
killer or a lost node ends a run mid-step (the records of the steps before it written, line by line)."""
import os
import signal
import sys
import time

from litespark_megatron import pretrain

AT, RANK = int(os.environ["HANG_AT_STEP"]), os.environ.get("HANG_RANK", "0")
_forward_step = pretrain.forward_step


def forward_step(data_iterator, model, *args, **kwargs):
    from megatron.training import get_args

    if get_args().curr_iteration + 1 == AT and os.environ.get("RANK", "0") == RANK:
        if os.environ.get("HANG_KILL") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    return _forward_step(data_iterator, model, *args, **kwargs)


pretrain.forward_step = forward_step  # train() hands megatron.training the module's forward_step

if __name__ == "__main__":
    sys.exit(pretrain.main())
