"""One variant of the inference benchmark, measured in its own process (the benchmark starts one per variant and
repeat, so no variant inherits another's allocator, compiled graphs or quantized modules):

    python -m litespark_megatron.apps.inference_run RUN_DIR

RUN_DIR/spec.json (written by inference_bench) says what to measure; the tokens of the evaluation and calibration
text are in the benchmark's text/ directory. Writes RUN_DIR/result.json (the measurements) and
RUN_DIR/predictions.pt (the top-1 next-token predictions on the evaluation windows, for the agreement with bf16),
each complete or not at all. Exit status 0, or 1 with the error on stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def calibrator(windows_file, device):
    """AWQ's calibration pass: every calibration window through the model, one window per forward (torchao's AWQ
    observer concatenates the inputs it saw along the sequence, so every forward must have the same batch size)."""
    import torch

    def calibrate(model):
        windows = torch.load(windows_file)
        with torch.inference_mode():
            for window in windows:
                model(input_ids=window.view(1, -1).to(device), use_cache=False)
    return calibrate


def measure(spec: dict, run_dir: Path, clock=time.perf_counter) -> dict:
    import torch

    from ..metrics.energy import EnergyMeter
    from . import inference_engine as engine
    from . import inference_quality as quality
    from .inference_variants import VARIANTS, quantize, weight_bytes

    variant = VARIANTS[spec["variant"]]
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(spec["seed"])
    text = Path(spec["text_dir"])
    eval_windows = torch.load(text / "eval.pt")
    quantization_config = None
    if variant.name == "nf4":
        from transformers import BitsAndBytesConfig

        quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_compute_dtype=torch.bfloat16)
    t0 = time.time()
    model = engine.load_llama(spec["hf"], variant.dtype, device, quantization_config)
    bytes_16bit = weight_bytes(model) if variant.name != "nf4" else None

    calibrate = calibrator(text / "calibration.pt", device) if variant.needs_calibration else None
    done = quantize(model, variant.name, cuda, calibrate, spec["quantize_lm_head"])
    result = dict(variant=variant.name, what=variant.what, device=spec["device_name"], **done,
                  load_and_quantize_s=round(time.time() - t0, 2), weight_bits_nominal=variant.weight_bits,
                  weight_bytes=weight_bytes(model), weight_bytes_16bit_same_load=bytes_16bit,
                  compiled=spec["compile"])

    batches = [eval_windows[i:i + spec["eval_batch"]] for i in range(0, eval_windows.shape[0], spec["eval_batch"])]
    scores = quality.evaluate(model, batches, device)
    predictions = scores.pop("predictions")
    result.update(eval_tokens=scores["tokens"], eval_nll_sum=scores["nll_sum"],
                  perplexity=quality.perplexity(scores["nll_sum"], scores["tokens"]),
                  top1_accuracy=scores["top1_hits"] / scores["tokens"])

    meter = EnergyMeter() if cuda else None
    energy_reason = "no GPU: NVML energy is measured on a CUDA GPU" if not cuda else None
    if meter is not None and not meter.start():
        energy_reason, meter = meter.reason, None
    stream = torch.load(text / "prompts.pt").tolist()
    dtype_bytes = 2  # the KV cache is kept in the activations' dtype, 16-bit in every variant
    read_per_step = result["weight_bytes"] - engine.embedding_bytes(model)
    peak_gbs = spec.get("peak_bandwidth_gbs")
    per_batch = []
    sync = engine.synchronizer(device)
    for batch in spec["batch_sizes"]:
        prompts = engine.prompts_from(stream, batch, spec["prompt_tokens"]).to(device)
        engine.reset_peak_memory(device)
        energy = {}

        def bracket(event):
            if meter is None:
                return
            if event == "start":
                meter.lap()  # what ran before (warm-up, TTFT calls) is not counted
            else:
                energy["reading"] = meter.lap()

        timing = engine.time_generation(model, prompts, spec["new_tokens"], spec["warmup"], spec["timed_calls"],
                                        sync, clock, bracket, compile=spec["compile"])
        row = timing.as_dict()
        row.update(engine.peak_memory(device))
        reading = energy.get("reading")
        tokens = timing.generated_tokens * timing.calls
        row.update(power_w=reading.watts if reading else None,
                   joules_per_token=reading.joules / tokens if reading else None,
                   energy_not_measured=None if reading else (energy_reason or (meter and meter.last_reason)))
        step = timing.decode_s_per_token
        step_bytes = engine.decode_bytes_per_step(read_per_step, model.config, dtype_bytes, batch,
                                                  spec["prompt_tokens"], spec["new_tokens"])
        achieved = step_bytes / step / 1e9 if step else None
        row.update(decode_bytes_per_step=step_bytes, decode_bandwidth_gbs=achieved,
                   mbu=achieved / peak_gbs if achieved and peak_gbs else None)
        per_batch.append(row)
    if meter is not None:
        meter.close()
    result["batches"] = per_batch
    result["peak_bandwidth_gbs"] = peak_gbs
    _write_atomically(run_dir / "predictions.pt", lambda p: torch.save(predictions, p))
    _write_atomically(run_dir / "result.json", lambda p: p.write_text(json.dumps(result, indent=1)))
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..platform import quiet_library_noise

    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print("usage: python -m litespark_megatron.apps.inference_run RUN_DIR", file=sys.stderr)
        return 2
    quiet_library_noise()
    run_dir = Path(argv[0])
    spec = json.loads((run_dir / "spec.json").read_text())
    measure(spec, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
