"""Checkpoints are Megatron-LM's: a litespark-train checkpoint resumes in a plain Megatron-LM script on megatron-core's
own layer and the other way round; checkpoints of the project's earlier trainer load with --finetune (and are
refused for an exact resume, with one line); Megatron-LM's own Llama-3 8B example command line trains here."""
import json
import re

import pytest

from conftest import TESTS, WORKER_DIR, child_env, forked, free_port, losses, made_once, ok, records, train

# The tiny Llama as Megatron-LM flags, and what a CPU needs (litespark-train adds those two groups itself).
LLAMA = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "352", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings",
         "4096", "--rotary-base", "10000", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--untie-embeddings-and-output-weights", "--vocab-size", "256"]
CPU = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
       "--no-rope-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
       "--no-bias-swiglu-fusion"]
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--lr", "3e-3", "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100",
       "--seed", "7", "--save-interval", "100"]


def stock(*flags):
    """The plain Megatron-LM script (forked from the test worker's zygote, which imported megatron-core and nothing of
    litespark-megatron); its per-step losses from Megatron-LM's own log lines."""
    proc = forked(1, WORKER_DIR / "stock_pretrain.py", *LLAMA, *CPU, *RUN, *flags,
                  env=child_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    found = [(int(step), float(loss)) for step, loss in
             re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", proc.stdout)]
    # megatron.training prints a run's first iteration without resetting its interval sums, so with log interval 1
    # the second line is the mean of the first two iterations: recover the second iteration's own loss.
    if len(found) > 1:
        found[1] = (found[1][0], 2 * found[1][1] - found[0][1])
    return proc, dict(found)


@pytest.fixture(scope="module")
def litespark_run(tmp_path_factory):
    """litespark-train's 4 steps of the tiny Llama, saved at 2 and 4: its checkpoint directory and losses."""
    def build(root):
        lit, lit_metrics = root / "lit", root / "lit.jsonl"
        ok(train(1, *LLAMA, *RUN, "--save", lit, "--save-interval", "2", "--metrics-file", lit_metrics))
        return lit, losses(lit_metrics)
    return made_once(tmp_path_factory, "litespark-run", build)


def test_litespark_checkpoint_resumes_in_megatron_lm_and_back(litespark_run, tmp_path):
    """Saved by litespark-train at step 2, resumed by the plain script (and the other way round): steps 3 and 4
    give what the saving run itself gave after step 2 (the Litespark layer and megatron-core's compute the same
    function, in other kernels: 1e-5). Each saving run trains 4 steps straight and saves at 2 and 4; the resuming
    run loads step 2 with Megatron-LM's --ckpt-step."""
    lit, reference = litespark_run
    proc, resumed = stock("--load", lit, "--ckpt-step", "2", "--save", tmp_path / "lit-then-stock")
    assert "successfully loaded checkpoint" in proc.stdout and sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - reference[step]) < 1e-5, (step, resumed, reference)

    stock_ckpt = tmp_path / "stock"
    _, stock_straight = stock("--save", stock_ckpt, "--save-interval", "2")
    assert (stock_ckpt / "iter_0000002").is_dir() and sorted(stock_straight) == [1, 2, 3, 4]
    back = tmp_path / "back.jsonl"
    ok(train(1, *LLAMA, *RUN, "--load", stock_ckpt, "--ckpt-step", "2", "--save", tmp_path / "stock-then-lit",
             "--metrics-file", back))
    again = losses(back)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert abs(again[step] - stock_straight[step]) < 1e-5, (step, again, stock_straight)


def test_use_checkpoint_args_builds_and_names_the_checkpoints_spec(litespark_run, tmp_path):
    """Megatron-LM's --use-checkpoint-args takes the checkpoint's --spec over the command line's: a Litespark
    checkpoint resumed with --spec stock-local trains the Litespark layer, and the run record names that layer (it
    named stock-local before, the layer it did not build)."""
    (ck, _), metrics = litespark_run, tmp_path / "resumed.jsonl"
    ok(train(1, *RUN, "--vocab-size", "256", "--use-checkpoint-args", "--load", ck, "--ckpt-step", "2", "--spec",
             "stock-local", "--metrics-file", metrics))
    (run_record,) = [r for r in records(metrics, "run") if "spec" in r]  # the other is the end's summary
    assert run_record["spec"] == "litespark", run_record


LEGACY = TESTS / "fixtures" / "legacy_checkpoint"


def test_checkpoint_of_the_earlier_trainer_loads_with_finetune(tmp_path):
    """tests/fixtures/legacy_checkpoint was written by the project's own trainer (megatron-core 0.16.1), with the
    model's loss on fixed tokens beside it. --finetune loads it (megatron.training's loader) into the same
    function: the same loss on those tokens."""
    reference = json.loads((LEGACY / "reference.json").read_text())
    flags = reference["model_flags"] + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
                                        "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0",
                                        "--eval-interval", "10", "--load", str(LEGACY), "--finetune"]
    proc = forked(1, WORKER_DIR / "checkpoint_worker.py", LEGACY / "reference.json", "--", *flags)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["mean_loss"]
    assert abs(got - reference["mean_loss"]) < 1e-6, (got, reference["mean_loss"])


def test_checkpoint_of_the_earlier_trainer_is_refused_for_an_exact_resume(tmp_path):
    reference = json.loads((LEGACY / "reference.json").read_text())
    proc = train(1, *reference["model_flags"], "--mock-data", "--lr", "1e-3", "--micro-batch-size", "2",
                 "--train-iters", "4", "--eval-interval", "4", "--load", LEGACY)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"litespark-train: error: --load {LEGACY}: a checkpoint of litespark-megatron's own "
                           "trainer") and "--finetune" in last, last


# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (core_r0.19.0), its flags as the script passes them
# (the shell keeps the quotes of '99,1,0'), verbatim.
LLAMA3_8B_FP8 = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path DATA_CACHE_PATH
--tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save CHECKPOINT_PATH --load CHECKPOINT_PATH --tensorboard-dir TENSORBOARD_LOGS_PATH
""".split()

# A model size a CPU trains in seconds; the schedule's sample counts scaled by the same 1/1,907,349 (megatron-core's
# mock dataset allocates index arrays for every sample of the run: 2 billion do not fit in a CPU's memory).
SHRUNK = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "224", "--num-attention-heads": "4",
          "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "64", "--max-position-embeddings": "64",
          "--vocab-size": "1024", "--train-samples": "1024", "--lr-decay-samples": "1022",
          "--lr-warmup-samples": "2"}
FP8 = ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather")


def _adapt(flags, paths):
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        value = flags[i + 1] if takes_value else None
        if flag in FP8:
            i += 2 if takes_value else 1
            continue
        out.append(flag)
        if takes_value:
            out.append(paths.get(value, SHRUNK.get(flag, value)))
        i += 2 if takes_value else 1
    return out


def test_megatron_lm_llama3_8b_example_flags_parse_unchanged_and_train(tmp_path):
    """Every one of the example's flags is accepted with Megatron-LM's meaning; with the model shrunk and FP8
    dropped (a CPU has neither the memory nor FP8), it trains 2 steps (--exit-interval) and saves, and the
    first-launch --load of its own --save directory starts fresh, as in Megatron-LM."""
    paths = {"DATA_CACHE_PATH": str(tmp_path / "cache"), "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
             "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb")}
    flags = _adapt(LLAMA3_8B_FP8, paths)
    assert len(LLAMA3_8B_FP8) == 129 and "--fp8-format" not in flags
    proc = ok(train(1, *flags, "--exit-interval", "2", timeout=600))
    found = re.findall(r"iteration\s+(\d+)/\s*8 \|.*?lm loss: ([0-9.E+-]+)", proc.stdout)
    assert [int(s) for s, _ in found] == [1, 2], proc.stdout[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "fused: cross-entropy native" in proc.stdout  # --cross-entropy-loss-fusion reached the model
