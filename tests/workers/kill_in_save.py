"""litespark-train that dies by SIGKILL in the middle of saving iteration $KILL_IN_SAVE_AT, as a trainer the OOM killer
picks would: the checkpoint directory holds part of iter_N and the tracker still names the previous save. The
process's children at that moment (checkpoint writer helpers, data-loader workers) are listed in iter_N/children."""
import os
import signal
import sys

from megatron.core import dist_checkpointing

from litespark_megatron.pretrain import main

AT = int(os.environ["KILL_IN_SAVE_AT"])
_save = dist_checkpointing.save


def save(state_dict, checkpoint_dir, *args, **kwargs):
    if os.path.basename(str(checkpoint_dir).rstrip("/")) == f"iter_{AT:07d}":
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, "__0_0.distcp"), "wb") as f:
            f.write(b"the first bytes of a shard")
        children = []
        for task in os.listdir("/proc/self/task"):
            children += open(f"/proc/self/task/{task}/children").read().split()
        with open(os.path.join(checkpoint_dir, "children"), "w") as f:
            f.write(" ".join(children))
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(state_dict, checkpoint_dir, *args, **kwargs)


dist_checkpointing.save = save  # megatron.training calls it through the module: dist_checkpointing.save(...)

if __name__ == "__main__":
    sys.exit(main())
