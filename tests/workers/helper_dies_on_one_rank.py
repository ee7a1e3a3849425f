"""litespark-train whose checkpoint save fails on rank $HELPER_DIES_ON_RANK alone, before the save's first
collective: the results-queue helper that megatron-core's writer starts dies at birth there (EOFError from
Manager.start, as when a scheduler's signal killed it). Rank 0 sees nothing of it: it waits in the save."""
import multiprocessing.managers
import os
import sys

from litespark_megatron.pretrain import main

if os.environ.get("RANK", "0") == os.environ["HELPER_DIES_ON_RANK"]:
    def start(self, *args, **kwargs):
        raise EOFError("the manager's helper process exited before it answered")

    multiprocessing.managers.SyncManager.start = start

if __name__ == "__main__":
    sys.exit(main())
