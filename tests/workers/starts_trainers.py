"""A tool that starts one-process training runs as the efficiency suite does (subprocess.Popen of `python -m
litespark_megatron`, output to a file), for tests/test_zygote.py: for each child, what the tool got back (the Popen
stand-in of tests/zygote.py or a real process), its exit status and the first line of its output, as JSON."""
import json
import os
import subprocess
import sys
import tempfile

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "3e-3", "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "100"]
children = {
    "trains": ([sys.executable, "-m", "litespark_megatron", *MOCK], {}),
    "refused": ([sys.executable, "-m", "litespark_megatron", *MOCK, "--no-such-flag"], {}),
    "new session": ([sys.executable, "-m", "litespark_megatron", *MOCK], {"start_new_session": True}),
    "another environment": ([sys.executable, "-m", "litespark_megatron", *MOCK],
                            {"env": {**os.environ, "TRITON_INTERPRET": "1"}}),
    "another program": ([sys.executable, "-c", "print('not a trainer')"], {}),
}
report = {}
for name, (cmd, kwargs) in children.items():
    with tempfile.NamedTemporaryFile("w+") as log:
        print(f"(the tool's own line before {name}: not in the child's output)", flush=False)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs)
        session = os.getsid(proc.pid) == proc.pid
        code = proc.wait(timeout=120)
        log.seek(0)
        text = log.read()
    report[name] = dict(kind=type(proc).__name__, code=code, own_session=session,
                        tool_line_in_output="the tool's own line" in text,
                        error=next((line for line in text.splitlines() if "error:" in line), None),
                        trained="iteration        1/       1" in text or "iteration 1/1" in text.replace(" ", ""))
print(json.dumps(report))
