"""litespark-train whose checkpoint writes fail with ENOSPC ("No space left on device") while saving iteration
$DISK_FULL_AT, as on a full filesystem: the failure comes from inside megatron-core's writer, mid-file."""
import errno
import functools
import os
import sys

from megatron.core.dist_checkpointing.strategies import filesystem_async

from litespark_megatron.pretrain import main

AT = int(os.environ["DISK_FULL_AT"])
_write_item = filesystem_async._write_item


@functools.wraps(_write_item)  # the writer reads its signature
def write_item(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
    if f"iter_{AT:07d}" in str(stream.name):
        stream.write(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(stream.name))
    return _write_item(*args, **kwargs)


filesystem_async._write_item = write_item  # the writer calls it through its module global

if __name__ == "__main__":
    sys.exit(main())
