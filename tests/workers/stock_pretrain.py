"""A plain Megatron-LM pretraining script in the shape of Megatron-LM's pretrain_gpt.py: Megatron-LM's own argument
parsing, megatron-core's own layer (no --spec: its default for --transformer-impl), its datasets and loss. Nothing
of litespark-megatron but the CPU platform shims, which a run on a CPU-only torch needs.

The checkpoint tests resume this script's checkpoints with litespark-train and the other way round.
"""
import sys
from functools import partial

import torch


def main():
    from litespark_megatron import platform

    platform.prepare_libraries()  # CPU shims; no-op patches on a GPU
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args, get_tokenizer, pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    keys = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
            "loss_mask", "max_seqlen", "position_ids", "tokens")

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def forward_step(data_iterator, model, return_schedule_plan=False):
        args = get_args()
        batch = {}
        if mpu.get_tensor_model_parallel_rank() == 0:
            batch = next(data_iterator)
            batch = {k: batch[k].cuda() if batch.get(k) is not None else None for k in keys}
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length, mtp_on_this_rank=False)
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                       loss_mask=batch["loss_mask"])
        return output, partial(loss_func, batch["loss_mask"])

    def datasets_provider(num_samples, vp_stage=None):
        args = get_args()
        config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                                  split=args.split, tokenizer=get_tokenizer(), reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False,
                                  create_attention_mask=args.create_attention_mask_in_dataloader,
                                  mid_level_dataset_surplus=args.mid_level_dataset_surplus)
        return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples,
                                             lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()

    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
