"""The checks `scripts/pretrain.sh` runs on every node before it starts torchrun.

A multi-node launch that cannot work otherwise fails late and obscurely: after a rendezvous timeout, inside the
first collective, or with a traceback from one rank out of hundreds. These checks make it fail in seconds, on the
node that is wrong, with one line that says what to change.

    python -m litespark_megatron.apps.launch_check layout --nnodes N --nproc-per-node auto|P -- TRAIN_ARGS...
        Resolves the processes per node (every visible GPU, or one process on a CPU-only node), checks them against
        the visible GPUs, then checks the training arguments (the trainer's own checks: arguments.check and
        Megatron-LM's validation) for the world size NNODES x P that the launcher will start. Prints one line for the launcher,
        `NPROC DEVICE ARCH TP PP CP` (ARCH: the GPU's compute capability major, 0 on CPU), also when a check
        fails, so that the launcher can still record the command it resolved.

    python -m litespark_megatron.apps.launch_check master --addr HOST --port PORT --node-rank R --wait SECONDS
        Resolves HOST. Node 0 (which hosts the rendezvous) checks that PORT is free here; every other node waits,
        at most SECONDS, until HOST:PORT accepts a TCP connection.

Every failure is one line `PROG: error: ...` on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
from typing import List, Optional, Sequence

EXIT_USAGE = 2


class LaunchError(Exception):
    """A launch that cannot work; the message says what is wrong and what to do."""


# --------------------------------------------------------------------------------------------- layout
def _visible_gpus():
    """(device, gpu count, compute capability major, te importable, fp8 capable) of this node."""
    from .. import platform

    plat = platform.detect()
    if plat.device_type != "cuda":
        return "cpu", 0, 0, False, False
    import torch

    return "cuda", torch.cuda.device_count(), torch.cuda.get_device_capability()[0], plat.te, plat.fp8_capable


def _nproc(requested: str, device: str, gpus: int) -> int:
    if requested == "auto":
        return gpus if device == "cuda" else 1
    if not requested.isdigit() or int(requested) < 1:
        raise LaunchError(f"GPUS_PER_NODE={requested!r} is not a positive integer (the processes to start on this "
                          "node, one per GPU)")
    return int(requested)


def check_layout(nnodes: int, nproc: int, device: str, gpus: int, train_args: Sequence[str], *,
                 te: bool, fp8_capable: bool, assumed: bool = False):
    """Raise LaunchError (or the trainer's ConfigError) for a launch that cannot run; return the resolved args."""
    from .. import arguments
    from ..platform import Platform

    if device == "cuda" and not assumed and nproc > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise LaunchError(f"GPUS_PER_NODE={nproc} but this node sees {gpus} GPU(s){where}: lower GPUS_PER_NODE, "
                          "or leave it unset to start one process per visible GPU")
    world = nnodes * nproc
    plat = Platform(device, "nccl" if device == "cuda" else "gloo", te, fp8_capable, device,
                    triton=True if assumed and device == "cuda" else None)
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)  # what Megatron-LM's argument parsing reads the world size from
    try:
        args = arguments.resolve_quietly(list(train_args), plat)
    finally:  # a caller in the same process (a tool, a test) keeps its own environment
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if min(tp, pp, cp) >= 1 and world % (tp * pp * cp):
        raise LaunchError(
            f"NNODES x GPUS_PER_NODE = {nnodes} x {nproc} = {world} processes is not divisible by TP x PP x CP = "
            f"{tp} x {pp} x {cp} = {tp * pp * cp} (from the training arguments): choose GPUS_PER_NODE and NNODES "
            f"whose product is a multiple of {tp * pp * cp}, or change the parallel layout")
    arguments.check_run(args, plat, world)
    return args


def layout_main(opts, train_args: List[str]) -> int:
    if opts.nnodes < 1:
        return _fail(opts.prog, f"NNODES={opts.nnodes} must be >= 1")
    if opts.assume_gpu:
        # Checking a config away from the GPUs (a login node): the layout as an H100/H200 node with TE would run it.
        device, gpus, arch, te, fp8 = "cuda", 0, 9, True, True
        if opts.nproc_per_node == "auto":
            return _fail(opts.prog, "--assume-gpu needs --nproc-per-node (there are no GPUs here to count)")
    else:
        try:
            device, gpus, arch, te, fp8 = _visible_gpus()
        except ImportError as e:
            return _fail(opts.prog, f"cannot import {e.name or e} with {sys.executable}: set PYTHON to the "
                                    "interpreter where litespark-megatron is installed (pip install -e .)")
    from ..errors import UserError

    try:
        nproc = _nproc(opts.nproc_per_node, device, gpus)
    except LaunchError as e:
        print(f"{opts.nproc_per_node} {device} {arch} - - -", flush=True)
        return _fail(opts.prog, str(e))
    try:
        args = check_layout(opts.nnodes, nproc, device, gpus, train_args, te=te, fp8_capable=fp8,
                            assumed=opts.assume_gpu)
    except (LaunchError, UserError) as e:
        print(f"{nproc} {device} {arch} - - -", flush=True)
        return _fail(opts.prog, str(e))
    except SystemExit as e:  # argparse already printed its usage and the offending flag
        print(f"{nproc} {device} {arch} - - -", flush=True)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    print(f"{nproc} {device} {arch} {args.tensor_model_parallel_size} {args.pipeline_model_parallel_size} "
          f"{args.context_parallel_size}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------- master
def _is_local(infos) -> bool:
    """Whether one of the resolved addresses belongs to this machine (binding it only works here)."""
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0) + tuple(sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def _port_free(port: int) -> Optional[OSError]:
    """torchrun's rendezvous store listens on every interface; bind the same way (SO_REUSEADDR, as the store does,
    so that sockets of a finished run in TIME_WAIT do not count as busy)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e
    return None


def master_main(opts) -> int:
    addr, port = opts.addr, opts.port
    if not 1 <= port <= 65535:
        return _fail(opts.prog, f"MASTER_PORT={port} is not a TCP port (1-65535)")
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return _fail(opts.prog, f"MASTER_ADDR={addr} does not resolve on this node ({e.strerror}): set it to an "
                                "address or hostname of the NODE_RANK=0 node that every node can resolve")
    if opts.node_rank == 0:
        err = _port_free(port)
        if err is not None:
            if err.errno == errno.EADDRINUSE:
                return _fail(opts.prog, f"MASTER_PORT={port} is already in use on this node (another job, or a "
                                        "previous run still exiting): choose another MASTER_PORT for every node")
            return _fail(opts.prog, f"cannot listen on MASTER_PORT={port} on this node ({err.strerror}): choose "
                                    "another MASTER_PORT (1024-65535) for every node")
        if not _is_local(infos):
            # A warning, not an error: behind NAT or a load balancer the address others use may not be local.
            print(f"{opts.prog}: warning: MASTER_ADDR={addr} is not an address of this node, yet NODE_RANK=0 hosts "
                  "the rendezvous here: the other nodes will look for it at MASTER_ADDR", file=sys.stderr,
                  flush=True)
        return 0
    start = time.monotonic()
    deadline = start + opts.wait
    last: Optional[OSError] = None
    while True:
        for family, kind, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, kind, proto) as s:
                    # A silently dropped SYN would otherwise block for the kernel's retry time (minutes).
                    s.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
                    s.connect(sockaddr)
                    if s.getsockname() == s.getpeername():
                        # Nobody listens on a port of this very host that lies in the ephemeral range: the kernel
                        # gave our socket that port and TCP's simultaneous open connected it to itself. Not a master
                        # (and while we hold the port, node 0 could not bind it).
                        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
                print(f"{opts.prog}: master {addr}:{port} reachable after {time.monotonic() - start:.0f} s",
                      flush=True)
                return 0
            except OSError as e:
                last = e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timed out" if isinstance(last, socket.timeout) else (last.strerror or str(last))
            return _fail(opts.prog, f"cannot reach the master at MASTER_ADDR={addr} MASTER_PORT={port} within "
                                    f"MASTER_WAIT_SECONDS={opts.wait:g} ({reason}): start the NODE_RANK=0 node (it "
                                    "listens there), check both variables and the firewall, or raise "
                                    "MASTER_WAIT_SECONDS")
        time.sleep(min(1.0, remaining))


# --------------------------------------------------------------------------------------------- entry point
def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m litespark_megatron.apps.launch_check",
                                description="Pre-launch checks of scripts/pretrain.sh (see the module docstring).")
    p.add_argument("--prog", default="launch_check", help="name printed in front of errors")
    sub = p.add_subparsers(dest="command", required=True)
    lay = sub.add_parser("layout", help="processes per node and the training layout; training arguments after --")
    lay.add_argument("--nnodes", type=int, required=True)
    lay.add_argument("--nproc-per-node", default="auto", help="processes per node, or auto (visible GPUs, 1 on CPU)")
    lay.add_argument("--assume-gpu", action="store_true",
                     help="check as on a Hopper GPU node with Transformer Engine (for a login node without GPUs)")
    mas = sub.add_parser("master", help="reach (or, on node 0, free) MASTER_ADDR:MASTER_PORT")
    mas.add_argument("--addr", required=True)
    mas.add_argument("--port", type=int, required=True)
    mas.add_argument("--node-rank", type=int, required=True)
    mas.add_argument("--wait", type=float, default=120.0, help="seconds a node with rank > 0 waits")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    opts = build_parser().parse_args(own)
    if opts.command == "layout":
        return layout_main(opts, train_args)
    return master_main(opts)


if __name__ == "__main__":
    sys.exit(main())
