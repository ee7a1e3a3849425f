"""One process, one bare model (no DDP, no optimizer) from litespark-train flags, for the workers that compare
layers on the same weights: megatron-core's own GPT builder with the run's layer spec and the layout-invariant
initialization, so every spec built from one seed starts from the same weights."""
import os

import torch

SEED = 7


def start():
    """Process groups of one rank (gloo on a CPU, NCCL on a GPU) and megatron-core's RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from litespark_megatron import platform

    plat = platform.prepare_libraries()
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(plat.dist_backend, rank=0, world_size=1,
                                         init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(SEED)
    return plat


def build(argv, plat):
    """The model litespark-train would build from argv (validated as it would be), initialized from SEED, in
    its parameter dtype, on this rank's device."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from litespark_megatron import arguments, model as model_lib

    args = arguments.resolve(["--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
                              "--train-iters", "1", "--seed", str(SEED), *argv], plat)
    arguments.megatron_validate(args)
    model = GPTModelBuilder(model_lib.model_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups())
    model = model.to(platform_device())
    model_lib.init_layout_invariant(model, model.config, SEED)
    if args.bf16:
        model = model.to(torch.bfloat16)
    return args, model


def platform_device():
    from litespark_megatron.platform import current_device

    return current_device()


def stop():
    torch.distributed.destroy_process_group()
