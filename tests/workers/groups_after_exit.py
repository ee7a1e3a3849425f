"""litespark-train, then one line per rank saying whether its process groups were left open when main() ended
(normally, or by megatron.training's sys.exit after a stop)."""
import sys

import torch.distributed as dist

from litespark_megatron import pretrain

if __name__ == "__main__":
    try:
        code = pretrain.main()
    except SystemExit as e:
        code = e.code
    print(f"GROUPS OPEN AFTER EXIT: {dist.is_initialized()}", flush=True)
    sys.exit(code)
