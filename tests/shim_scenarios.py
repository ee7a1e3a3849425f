"""One small megatron-core action per CPU shim, run in a fresh process with a chosen set of shims.

    LITESPARK_CPU_SHIMS=<list> python tests/shim_scenarios.py <scenario>

Prints `OK` when the action succeeds, else `FAILED <exception type>: <message> @ <innermost function>` (exit 1).
test_platform.py runs each scenario with all shims (must print OK) and without the shim it needs (must fail
with the error that shim exists to fix).
"""
import datetime
import os
import sys
import traceback

import torch


def _args(*flags):
    from litespark_megatron import config

    return config.resolve(["--seq-length", "16", "--vocab-size", "128", "--hidden-size", "64",
                           "--ffn-hidden-size", "128", "--num-layers", "2", *flags])


def _start(args):
    from litespark_megatron import platform

    os.environ.setdefault("MASTER_PORT", str(platform._free_port()))
    return platform.init_distributed(args)


def _tiny_model(args, spec_backend="local"):
    from litespark_megatron import model as model_lib

    cfg = model_lib.transformer_config(args, spec_backend, "cpu")
    return cfg, model_lib.build_model(args, cfg, spec_backend, args.vocab_size)


def scenario_dev():
    """Forward pass: RoPE and the embedding ask torch.cuda.current_device()."""
    args = _args()
    _start(args)
    _, (model,) = _tiny_model(args)
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum().backward()


def scenario_rng():
    """Seeding megatron's model-parallel RNG streams."""
    from megatron.core import parallel_state, tensor_parallel
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from litespark_megatron import platform

    platform.apply_cpu_shims()
    os.environ.setdefault("MASTER_PORT", str(platform._free_port()))
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def scenario_misc():
    """Process-group timeout update synchronizes the device."""
    args = _args()
    _start(args)
    from megatron.core import parallel_state

    parallel_state.update_pg_timeout(datetime.timedelta(minutes=5))


def scenario_mode():
    """Building the megatron optimizer allocates its found-inf tensor with device='cuda'."""
    args = _args()
    _start(args)
    from litespark_megatron.training import optim

    cfg, chunks = _tiny_model(args)
    optim.build_optimizer(args, optim.wrap_model(args, cfg, chunks))


def scenario_spnorm():
    """The stock local spec's norm (WrappedTorchNorm) under sequence parallelism (TP2 + SP config)."""
    from litespark_megatron import model as model_lib, platform

    platform.apply_cpu_shims()
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    args = _args("--tensor-model-parallel-size", "2", "--sequence-parallel")
    norm = WrappedTorchNorm(model_lib.transformer_config(args, "local", "cpu"), 64)
    assert all(p.sequence_parallel for p in norm.parameters()), "norm weights not tagged for SP grad all-reduce"


def scenario_moe():
    """A megatron-core MoE layer (4 experts, top-2, alltoall dispatcher) forward and backward."""
    args = _args()
    _start(args)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from litespark_megatron import model as model_lib
    import dataclasses

    cfg = model_lib.transformer_config(args, "local", "cpu")
    cfg = dataclasses.replace(cfg, num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                              moe_aux_loss_coeff=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"), vocab_size=128,
                     max_sequence_length=16, position_embedding_type="rope")
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).sum().backward()


def main():
    name = sys.argv[1]
    try:
        globals()[f"scenario_{name}"]()
    except BaseException as e:  # report every failure the same way, including assertion errors
        frames = traceback.extract_tb(e.__traceback__)
        where = ",".join(f.name for f in frames[-3:])
        print(f"FAILED {type(e).__name__}: {e} @ {where}", flush=True)
        sys.exit(1)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
