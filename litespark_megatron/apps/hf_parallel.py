"""HF transformers' LlamaForCausalLM trained data-parallel, with torch's DDP or FSDP2, measured like litespark-train.

    torchrun --nproc-per-node 2 -m litespark_megatron.apps.hf_parallel --parallel fsdp2 --model llama-3b \\
        --seq-length 4096 --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --log-interval 5 \\
        --metrics-file runs/hf-fsdp2/metrics.jsonl

This is the baseline a team without Megatron would run on several GPUs: the HF model (the benchmark's `hf-eager`:
SDPA attention, bf16 parameters, gradients and AdamW states) under torch's own data parallelism:

* `--parallel ddp`: every rank holds the whole model, DistributedDataParallel all-reduces the gradients once per
  optimizer step (`no_sync` on the other micro-batches);
* `--parallel fsdp2`: `fully_shard` on each decoder layer and on the model (parameters, gradients and optimizer
  states sharded over the ranks; a layer's parameters all-gathered for its forward and again for its backward), the
  gradients reduce-scattered once per optimizer step.

The other flags are litespark-train's (resolved by the same parser, so that the shape, batch and optimizer flags of a
Litespark run give the same model and step here): the model shape, `--seq-length`, `--micro-batch-size`,
`--global-batch-size` (accumulation = global / (micro x ranks)), `--train-iters`, `--log-interval`, `--seed`,
`--lr`, `--weight-decay`, `--adam-beta1/2`, `--adam-eps`, `--clip-grad`, `--metrics-file`. The LR is constant (a
throughput baseline, not a schedule); the tokens are random, uniform over the vocabulary, the same global batches
as the benchmark's HF systems draw (data flags are accepted and not read). What HF cannot run is refused in one
line before any process group exists: tensor, pipeline, context or expert parallelism, FP8, FP16, recompute, and
any flag that makes the model other than Llama's (MoE, MLA, NSA, NoPE, LayerNorm, biases, QK norm).

Writes metrics.jsonl records in docs/metrics.md's schema through litespark-train's own Telemetry (intervals,
tokens/s, TFLOP/s and MFU in both conventions, NVML energy of every GPU, peak memory, forward time per rank, what ran:
the SDPA kernel), so `tools/layout_sweep.py` tabulates it beside Litespark's layouts (`--layout 2:hf-fsdp2`), and
with `--tensorboard-dir` the same TensorBoard scalars as a litespark-train run, its loss, gradient norm and learning
rate under megatron.training's tags.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import List, NoReturn, Optional, Sequence

from ..telemetry import Telemetry

PROG = "hf_parallel"
PARALLEL = ("ddp", "fsdp2")


class HFTelemetry(Telemetry):
    """litespark-train's Telemetry for a run that megatron.training does not drive: it starts at step 0."""

    def _start_iteration(self) -> int:
        return 0

    def _warn_without_te_fused_attention(self) -> None:
        pass  # the HF model runs torch's SDPA, not TE's attention: its kernel is in the health record

    def describe_data(self, args) -> str:
        return "random tokens (uniform over the vocabulary)"  # iter_token_batches, whatever data flags were given

    _writer = None

    def _tensorboard_writer(self):
        """Its own writer on --tensorboard-dir (megatron.training, which opens one, does not run here)."""
        if not self.is_writer or not self.args.tensorboard_dir:
            return None
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.args.tensorboard_dir)
        return self._writer

    def _tensorboard(self, iteration: int, record: dict) -> None:
        """Telemetry's scalars, and what megatron.training itself would write, under its tags: an HF run's curves
        overlay a Litespark run's in one TensorBoard."""
        super()._tensorboard(iteration, record)
        writer = self._tensorboard_writer()
        if writer is not None:
            for tag, key in (("lm loss", "loss"), ("grad-norm", "grad_norm"), ("learning-rate", "lr")):
                if record.get(key) is not None:
                    writer.add_scalar(tag, record[key], iteration)

    def finish(self, iteration: int) -> None:
        super().finish(iteration)
        if self._writer is not None:  # the process leaves through os._exit: nothing would flush it after this
            self._writer.close()
            self._writer = None


def parse(argv: Sequence[str]):
    """(--parallel, the resolved litespark-train args); ConfigError (one line) for what HF cannot run."""
    from ..arguments import resolve_quietly
    from ..errors import ConfigError
    from .cli import OneLineParser
    from ..platform import detect

    own = OneLineParser(prog=PROG, add_help=False)
    own.add_argument("--parallel", choices=PARALLEL, default="fsdp2")
    opts, rest = own.parse_known_args(list(argv))
    plat = detect()
    args = resolve_quietly(rest, plat)
    refused = [(name, flag) for name, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
        ("context_parallel_size", "--context-parallel-size"),
        ("expert_model_parallel_size", "--expert-model-parallel-size")) if (getattr(args, name, 1) or 1) > 1]
    if refused:
        name, flag = refused[0]
        raise ConfigError(f"{flag} {getattr(args, name)}: HF transformers runs data-parallel only here "
                          f"(--parallel {'|'.join(PARALLEL)}); drop the flag")
    if args.recompute_granularity:
        raise ConfigError(f"--recompute-granularity {args.recompute_granularity}: the HF baseline keeps its "
                          "activations (no recompute); drop the flag")
    if args.fp8 or args.fp16:
        raise ConfigError(f"{'--fp8-format' if args.fp8 else '--fp16'}: the HF baseline trains in bf16 (fp32 on a "
                          "CPU); drop the flag")
    # The HF model is Llama's architecture: a flag that changes it would make the comparison one of two models.
    other_model = [flag for flag, differs in (
        ("--num-experts", getattr(args, "num_experts", None)),
        ("--multi-latent-attention", args.multi_latent_attention),
        ("--attention-variant nsa", getattr(args, "attention_variant", "dense") != "dense"),
        (f"--position-embedding-type {args.position_embedding_type}", args.position_embedding_type != "rope"),
        (f"--normalization {args.normalization}", args.normalization != "RMSNorm"),
        ("biases in the linear layers (no --disable-bias-linear)", args.add_bias_linear),
        ("--qk-layernorm", args.qk_layernorm),
        ("no --swiglu", not args.swiglu)) if differs]
    if other_model:
        raise ConfigError(f"{other_model[0]}: the HF baseline is the dense Llama model (RoPE, RMSNorm, SwiGLU, no "
                          "biases); drop the flag")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gbs, mbs = args.global_batch_size or args.micro_batch_size, args.micro_batch_size
    if gbs % (mbs * world):
        raise ConfigError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x {world} "
                          f"ranks; use a multiple of {mbs * world}")
    args.global_batch_size = gbs
    cuda = plat.device_type == "cuda"
    # What the run record and the "what ran" line name: this model and its data parallelism, in its dtype.
    args.bf16, args.fp16, args.fp8 = cuda, False, None
    args.litespark_spec, args.transformer_impl = f"hf-{opts.parallel}", "hf-transformers"
    args.padded_vocab_size = args.vocab_size  # HF's embedding has the vocabulary's rows, unpadded
    args.consumed_train_samples = 0
    return opts.parallel, args, plat


def _init_distributed(plat):
    import torch
    import torch.distributed as dist

    from ..platform import single_process_defaults

    single_process_defaults()  # started without torchrun: rank 0 of 1
    local = int(os.environ["LOCAL_RANK"])
    if plat.device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def wrap(model, parallel: str, device):
    """The model under DDP or FSDP2; a function that turns gradient synchronization on or off for a micro-batch."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

        def sync(on: bool):
            return contextlib.nullcontext() if on else ddp.no_sync()

        return ddp, sync
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    def sync(on: bool):
        model.set_requires_gradient_sync(on)
        return contextlib.nullcontext()

    return model, sync


def train(parallel: str, args, plat) -> NoReturn:
    """Train, write the metrics, and end the process with status 0 (see the end)."""
    import torch
    import torch.distributed as dist

    from .. import backend_probe
    from .hf_model import build_hf_llama, hf_adamw, iter_token_batches

    device = _init_distributed(plat)
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    telemetry = HFTelemetry(args, plat)
    model = build_hf_llama(args, cuda, device)  # the same seed on every rank: the same initial weights
    model.train()
    forward, sync = wrap(model, parallel, device)
    optimizer = hf_adamw(model, args.lr, args.weight_decay, (args.adam_beta1, args.adam_beta2), args.adam_eps, cuda)
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    per_rank = gbs // world
    accumulation = per_rank // mbs
    # This rank's rows of each global batch: the ranks together train exactly the global batch one process would.
    # The benchmark's tokens, drawn as the steps need them (a long run's would take gigabytes up front).
    batches = iter_token_batches(args.train_iters, gbs, args.seq_length, args.vocab_size, args.seed)

    def step(tokens) -> tuple:
        tokens = tokens[rank * per_rank:(rank + 1) * per_rank].to(device, non_blocking=True)
        total = torch.zeros((), device=device, dtype=torch.float32)
        for k in range(accumulation):
            x = tokens[k * mbs:(k + 1) * mbs, :-1]  # seq_length inputs; HF shifts the labels inside
            with sync(k == accumulation - 1):  # gradients reduced once, with the last micro-batch's backward
                with telemetry.timed_forward():
                    loss = forward(input_ids=x, labels=x).loss / accumulation
                loss.backward()
            total += loss.detach().float()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return total / world, float(norm)

    telemetry.begin()
    for iteration, tokens in enumerate(batches, start=1):
        if iteration == 1:  # what ran, seen on the first step (its interval is start-up: tools drop it)
            with backend_probe.BackendProbe([model]) as probe:
                loss, norm = step(tokens)
            telemetry.record_health(probe.report(device_type=device.type))
        else:
            loss, norm = step(tokens)
        args.consumed_train_samples += gbs
        telemetry.on_iteration(iteration, {"lm loss": loss}, args.lr, None, False, norm)
        if rank == 0 and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            print(f" iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss.item():.6E} | "
                  f"grad norm: {norm:.3f}", flush=True)
    telemetry.finish(args.train_iters)
    # Every rank is past its last collective; leave without torch's teardown. On gloo it can abort a rank whose peer
    # closed its connections first (SIGABRT) or hang it in the group's destructor when DDP's reducer is freed at
    # interpreter exit (a finished run that never ended): both seen on a loaded CPU machine.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[List[str]] = None) -> int:
    from ..errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        parallel, args, plat = parse(argv)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"{PROG}: error: HuggingFace transformers is not importable here ({e}): pip install transformers",
              file=sys.stderr, flush=True)
        return 2
    train(parallel, args, plat)


if __name__ == "__main__":
    sys.exit(main())
