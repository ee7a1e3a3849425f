"""tools/kernel_bench.py: its refusals on this CPU machine, and its table (the GPU runs it: docs/benchmarks)."""
import pytest

from litespark_megatron.apps import kernel_bench


@pytest.mark.parametrize("argv, message", [
    ([], "kernel_bench.py: error: give --hidden N or --model NAME (see --help)"),
    (["--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels it compares run on a GPU"),
])
def test_refusals_are_one_line_and_exit_2(argv, message, capsys):
    assert kernel_bench.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_bad_flags_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        kernel_bench.main(["--hidden", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("kernel_bench.py: error: argument --hidden: a positive integer "
                                               "expected, got '0' (see --help)")


def test_table_shows_kernel_time_wall_time_and_error_and_says_why_a_row_did_not_run():
    base = dict(kernel="rms-norm", hidden=3072, tokens=16384, dtype="bfloat16")
    rows = [dict(base, candidate="litespark", forward_ms=0.053, forward_kernel_ms=0.049, forward_gb_s=4108.0,
                 forward_backward_ms=0.494, forward_backward_kernel_ms=0.163, forward_backward_gb_s=3088.5,
                 error_y=5.0e-3, error_dx=2.0e-3, error_dw=3.5e-3),
            dict(base, candidate="te", unavailable="Transformer Engine does not import (ImportError)")]
    assert kernel_bench.render(rows).splitlines()[2:] == [
        "| rms-norm | litespark | 3072 | 16384 | bfloat16 | 0.049 / 4,108 / 0.053 | 0.163 / 3,088 / 0.494 | "
        "5.0e-03 / 2.0e-03 / 3.5e-03 |",
        "| rms-norm | te | 3072 | 16384 | bfloat16 | not run: Transformer Engine does not import (ImportError) | | |"]
