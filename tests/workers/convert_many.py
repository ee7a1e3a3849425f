"""Several litespark-convert commands in one process (each a fresh gloo world of one), for tests that convert many
checkpoints: the process starts once.

    python tests/workers/convert_many.py OUT.json -- ARGV1... -- ARGV2...

OUT.json: [[exit code, the last line on stderr or ""], ...], one per command, in order.
"""
import contextlib
import io
import json
import sys


def main():
    from litespark_megatron import hf_convert as hf

    commands, current = [], None
    for token in sys.argv[2:]:
        if token == "--":
            current = []
            commands.append(current)
        else:
            current.append(token)
    results = []
    for argv in commands:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = hf.main(argv + ["--quiet"])
        lines = err.getvalue().strip().splitlines()
        results.append([code, lines[-1] if lines else ""])
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
