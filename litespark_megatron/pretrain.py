"""`litespark-train` (also `python -m litespark_megatron`): Megatron-LM's pretrain_gpt.py with the Litespark layer.

The trainer is megatron.training's own `pretrain`: its loop, arguments, checkpoints, signal handling, NaN checks
(the rerun state machine), async saves, TensorBoard and W&B. What this module adds is what pretrain_gpt.py adds
to it (the forward step, the loss with its checks, the datasets provider) and the Litespark pieces:

    main(argv) -> platform.prepare_libraries     the package of every library patch (CPU shims, 5 gaps)
               -> arguments.parse_checked        Megatron-LM flags (+ presets, --config, checks)
               -> corpus.prepare_embedded_corpus --embedded-corpus: the corpus built (once, cached)
               -> stdlib_sft.prepare_embedded_sft --embedded-sft: the SFT set built (once, cached)
               -> data.check                     data and tokenizer checked before any process group
               -> sft_data.prepare               --sft-data: every row read and tokenized (a bad row: one line)
               -> checkpoint_dir.lock / clean    --save held by this run alone; refused if its saves would
                                                 overwrite complete checkpoints it did not load; unfinished saves
                                                 removed, older checkpoints pruned (--keep-last-checkpoints)
               -> set_global_variables           get_args(); Ctrl-C joins SIGTERM with --exit-signal-handler
               -> telemetry.attach               MFU, energy, J/token, metrics.jsonl beside Megatron-LM's logs
               -> checkpoint_dir.attach,         listeners, as telemetry is, of megatron.training's loop
                  watchdog.start                 (platform.callbacks wraps it and tells them)
               -> megatron.training.pretrain     model from model.model_config_from_args (the --spec layer)
               -> [--sample-prompt]              a greedy continuation printed after training
"""
from __future__ import annotations

import os
import sys
import time
from functools import partial

_PROGRAM_START_TIME = time.time()

import torch  # noqa: E402

from . import arguments, platform  # noqa: E402
from .errors import PROG, UserError  # noqa: E402

# Fields of a GPT batch, in the order megatron-core's batch utilities expect them.
BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens")
SPIKY_LOSS_FACTOR = 10  # a loss 10x the largest seen so far is spiky (pretrain_gpt.py's definition)
# Tests inject a NaN loss, or a loss 100x too large, at a chosen step (1-based) to prove that the run's checks catch
# it; unset in real runs.
_NAN_AT, _SPIKE_AT = (int(os.environ[name]) if os.environ.get(name) else None
                      for name in ("LITESPARK_TEST_NAN_AT_STEP", "LITESPARK_TEST_SPIKE_AT_STEP"))


# --------------------------------------------------------------------------------------------- the step
def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: read on TP rank 0 of the first and last pipeline stages, broadcast over TP, then
    sliced for this CP rank (megatron-core's load-balanced split). Other stages get None."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None
                 for key in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())


def loss_func(loss_mask, output_tensor):
    """Summed loss, token count and the 'lm loss' report (megatron.training averages it over tokens and DP), with
    pretrain_gpt.py's checks: a NaN or Inf loss is fatal (the rerun state machine tells a transient fault from a
    reproducible one and stops the run), a spiky loss is reported."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    if _NAN_AT is not None and args.curr_iteration + 1 == _NAN_AT:
        losses = losses * float("nan")  # test-only fault (LITESPARK_TEST_NAN_AT_STEP): the checks below must stop it
    if _SPIKE_AT is not None and args.curr_iteration + 1 == _SPIKE_AT:
        losses = losses * 100.0  # test-only fault (LITESPARK_TEST_SPIKE_AT_STEP): --loss-spike-factor must see it
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        rerun.validate_result(result=loss, rejection_func=torch.isnan, tolerance=0.0, fatal=True,
                              message="found NaN in local forward loss calculation")
        rerun.validate_result(result=loss, rejection_func=torch.isinf, tolerance=0.0, fatal=True,
                              message="found Inf in local forward loss calculation")
    if args.check_for_spiky_loss:
        rerun.validate_result(result=loss, tolerance=0.0, fatal=False, message="Spiky loss",
                              rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                     context="loss"))
    return loss, num_tokens, report


_probed = False


def forward_step(data_iterator, model):
    """One micro-batch forward. The first one in this process runs under the backend probe (backend_probe.py): which
    attention kernel and fused paths ran is logged once and recorded for the tools. (No return_schedule_plan:
    --overlap-moe-expert-parallel-comm, under which megatron-core asks for the model's schedule plan, is refused.)"""
    global _probed
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training.training import stimer  # Megatron-LM's --log-straggler timer, as in pretrain_gpt.py

    from . import telemetry

    with telemetry.timed_forward():
        with stimer(bdata=True):
            batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
        if batch is None:
            tokens = position_ids = attention_mask = labels = loss_mask = None
        else:
            tokens, position_ids, labels, loss_mask = (batch[k] for k in ("tokens", "position_ids", "labels",
                                                                          "loss_mask"))
            attention_mask = batch["attention_mask"]
        run = partial(model, tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
                      **_output_processor())
        with stimer:
            if _probed:
                output = run()
            else:
                _probed = True
                output = _probed_forward(run, model)
    return output, partial(loss_func, loss_mask)


def _output_processor() -> dict:
    """GPTModel.forward's output_processor for --chunked-output-loss, --litespark-cross-entropy and
    --litespark-fp8-output-layer; none otherwise (megatron-core's own path)."""
    from megatron.training import get_args

    args = get_args()
    fp8_output_layer = bool(getattr(args, "litespark_fp8_output_layer", False))
    if args.chunked_output_loss is None and not args.litespark_cross_entropy and not fp8_output_layer:
        return {}
    from .output_loss import chunked_output_loss

    return {"output_processor": chunked_output_loss(args.chunked_output_loss, args.litespark_cross_entropy,
                                                    fp8_output_layer)}


def _probed_forward(run, model):
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    from . import backend_probe, telemetry

    telemetry.begin()
    with backend_probe.BackendProbe([model]) as probe:
        output = run()
    args, device_type = get_args(), platform.detect().device_type
    cross_entropy = None
    if args.litespark_cross_entropy:  # the output processor's loss, not the config's
        from .kernels.cross_entropy import cross_entropy_path

        cross_entropy = cross_entropy_path(device_type)
    rms_norm = None
    if args.litespark_rmsnorm:
        from .kernels.rms_norm import rms_norm_path

        rms_norm = rms_norm_path(device_type)
        if any(getattr(m, "fp8_ran", False) for m in model.modules()):
            rms_norm += " fp8"  # the norms wrote their GEMMs' FP8 inputs (layers/norm.py)
    rope = None
    if args.litespark_rope:
        from .kernels.qkv_rope import qkv_rope_path

        rope = qkv_rope_path(device_type)
        if any(getattr(m, "rope_fp8_grad_ran", False) for m in model.modules()):
            rope += " fp8 grad"  # the backward wrote the QKV GEMM's FP8 output gradient (layers/attention.py)
    output_layer = None
    if getattr(args, "litespark_fp8_output_layer", False):
        from .kernels.fp8_logits import fp8_logits_path

        output_layer = fp8_logits_path(device_type)
    optimizer = None
    if args.litespark_adam and platform.adam_in_use():
        from .kernels.adam import adam_path

        optimizer = adam_path(device_type)
    report = probe.report(config=get_model_config(model), requested=backend_probe.requested_fusions(args),
                          device_type=device_type, cross_entropy=cross_entropy, rms_norm=rms_norm, rope=rope,
                          output_layer=output_layer, optimizer=optimizer)
    telemetry.record_health(report)
    return output


# --------------------------------------------------------------------------------------------- the data
def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT datasets from --data-path (or megatron-core's mock dataset with --mock-data), or SFT datasets from
    --sft-data (sft_data.py), built on the ranks that read batches."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

    args = get_args()

    def built_here():
        return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    if args.sft_data:
        from . import sft_data

        return sft_data.datasets(args, train_val_test_num_samples, built_here())
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed if args.data_seed is None else args.data_seed, sequence_length=args.seq_length,
        blend=blend, blend_per_split=blend_per_split, split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here, config).build()


datasets_provider.is_distributed = True


# --------------------------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _default_stop_signals()
    try:
        args, plat = prepare(argv)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        code = train(args, plat)
    except SystemExit as e:  # megatron.training's exit after a signal or an exit limit, or a failed check
        if e.code in (0, None):
            _leave_process_groups()
        raise
    _leave_process_groups()
    return code


def prepare(argv):
    """Everything checked before any work (libraries, arguments, data), then the --save directory taken, then
    megatron.training's global state (get_args(), TensorBoard). Raises UserError with one line."""
    platform.quiet_library_noise()
    plat = platform.prepare_libraries()  # before anything imports megatron: its patches apply to what comes after
    from megatron.training.global_vars import set_global_variables

    from . import checkpoint_dir, corpus, data, sft_data, stdlib_sft

    args = arguments.parse_checked(argv, plat)
    corpus.prepare_embedded_corpus(args)
    stdlib_sft.prepare_embedded_sft(args)
    data.check(args)
    sft_data.prepare(args)
    checkpoint_dir.lock(args)
    checkpoint_dir.clean(args)
    set_global_variables(args)
    if args.exit_signal_handler:
        _ctrl_c_like(args.exit_signal, saves=bool(args.save))
    return args, plat


def _default_stop_signals() -> None:
    """scripts/pretrain.sh starts torchrun with SIGTERM and SIGINT ignored (it forwards them to the workers itself),
    and the workers inherit that; it says so in LITESPARK_RESTORE_STOP_SIGNALS. Until megatron.training installs its
    handler, they must stop as usual. (A run a shell started in the background keeps its ignored SIGINT.)"""
    import signal

    if os.environ.get("LITESPARK_RESTORE_STOP_SIGNALS") != "1":
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ctrl_c_like(exit_signal, saves: bool) -> None:
    """Ctrl-C (SIGINT) does what --exit-signal-handler's signal does: save at the next step and exit 0, instead of
    a KeyboardInterrupt traceback wherever the run happened to be. The handler re-sends the exit signal to this
    process, so megatron.training's handler (and its agreement of all ranks on the step) does the rest; forked
    data-loader workers inherit it and stay alive for the steps before the save. megatron.training's exit line names
    SIGTERM whatever the signal was: rank 0's trainer says first that it was Ctrl-C."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        return  # started to ignore Ctrl-C (a shell's background job): it stays so
    trainer = os.getpid()
    then = ": a checkpoint at the next step, then exit" if saves else " at the next step, then exit"
    line = f"{PROG}: Ctrl-C (SIGINT): stopping as on {signal.Signals(exit_signal).name} " \
           f"(--exit-signal-handler){then}\n".encode()

    def handler(signum, frame):
        if os.getpid() == trainer and os.environ.get("RANK", "0") == "0":
            os.write(sys.stdout.fileno(), line)  # not print(): the signal may have come in the middle of one
        os.kill(os.getpid(), exit_signal)

    signal.signal(signal.SIGINT, handler)


def train(args, plat) -> int:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from . import checkpoint_dir, model, sample, telemetry, watchdog

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    model_config = model.model_config_from_args(args)
    if args.sample_prompt is not None:
        model_config.post_wrap_hooks.append(sample.keep_model)
    if args.litespark_adam:
        platform.use_litespark_adam()
    telemetry.attach(args, plat)
    checkpoint_dir.attach(args)
    watchdog.start(args)
    try:  # megatron.training leaves through sys.exit(0) after a signal or an exit limit
        pretrain(pretrain_cfg_container_from_args(args, model_config), datasets_provider,
                 ModelType.encoder_or_decoder, forward_step)
    except SystemExit as e:
        _explain_failed_validation(e.code, args)
        raise
    finally:
        checkpoint_dir.finish()
    if args.sample_prompt is not None:
        sample.print_sample(args)
    telemetry.finish()
    return 0


def _leave_process_groups() -> None:
    """A run that ended well (trained, or stopped by a signal or a limit on every rank at one step) leaves its
    process groups together: a barrier, then torch's teardown. megatron.training's `pretrain` returns with them open;
    left to the interpreter's exit, a rank whose peers already closed their connections can abort in a
    communication thread (gloo: "terminate called without an active exception", SIGABRT) and fail a run that
    finished. (After a failure no barrier: the other ranks may never reach it.)"""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _explain_failed_validation(code, args) -> None:
    """megatron.training's rerun state machine stops a run whose loss or gradients were NaN/Inf (or a fatal check
    failed) with exit code 16 or 17, after several log lines that number the iteration one past the step. Each rank
    whose own check failed says it in one line: the step, the rank, what was non-finite."""
    from megatron.core.rerun_state_machine import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                                   EXIT_CODE_RESUME_TO_DISAMBIGUATE, get_rerun_state_machine)

    if code not in (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE):
        return
    machine = get_rerun_state_machine()
    failed = machine.failed_validation_call
    if failed is None:
        return  # another rank's check failed; this one stops with it
    step = args.curr_iteration + 1
    saved = (f"the checkpoint of step {step - 1} in {args.save} holds the state before it: resumed on another node, "
             "megatron.training re-runs the step there to tell a faulty GPU from the data; --rerun-mode disabled "
             "resumes it anywhere" if code == EXIT_CODE_RESUME_TO_DISAMBIGUATE and args.save
             else "no checkpoint holds it")
    print(f"{PROG}: error: step {step}: {failed.caller.message} (rank {failed.caller.rank}, value "
          f"{machine.initial_result}); the step was not applied, {saved}; exit {code}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
