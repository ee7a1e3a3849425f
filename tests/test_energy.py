"""EnergyMeter on replayed NVML counter sequences (no GPU needed), and summarize()."""
import sys
import types

import pytest

from litespark_megatron.metrics.energy import COUNTER_MODULUS, EnergyMeter, summarize


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Replay:
    """reader(device) -> the next value queued for that device; an Exception instance is raised instead."""

    def __init__(self, **sequences):
        self.queues = {dev: list(values) for dev, values in sequences.items()}

    def __call__(self, dev):
        value = self.queues[dev].pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    def exhausted(self):
        return all(not q for q in self.queues.values())


def make(**sequences):
    clock, reader = Clock(), Replay(**sequences)
    meter = EnergyMeter(list(sequences), reader=reader, clock=clock)
    return meter, clock, reader


def test_laps_difference_the_counter():
    meter, clock, reader = make(gpu0=[1_000, 3_000, 6_500])
    assert meter.start() and meter.available and meter.reason is None
    clock.t = 2.0
    first = meter.lap()
    assert (first.joules, first.seconds, first.watts) == (2.0, 2.0, 1.0)
    clock.t = 5.0
    second = meter.lap()
    assert (second.joules, second.seconds) == (3.5, 3.0)
    assert (meter.total_joules, meter.total_seconds) == (5.5, 5.0)
    assert reader.exhausted()


def test_all_local_gpus_are_summed():
    meter, clock, _ = make(gpu0=[0, 1_000], gpu1=[500, 4_500])
    meter.start()
    clock.t = 1.0
    reading = meter.lap()
    assert reading.joules == 5.0
    assert reading.per_device_joules == {"gpu0": 1.0, "gpu1": 4.0}


def test_unsigned_64_bit_wraparound():
    meter, clock, _ = make(gpu0=[COUNTER_MODULUS - 500, 700])
    meter.start()
    clock.t = 1.0
    assert meter.lap().joules == 1.2


def test_counter_going_backwards_is_not_measured_not_negative():
    # Driver reload: the counter restarts near 0. That lap is unknown; the next one is fine again.
    meter, clock, _ = make(gpu0=[5_000_000, 100, 2_100])
    meter.start()
    clock.t = 1.0
    assert meter.lap() is None
    assert "backwards" in meter.last_reason and meter.laps_not_measured == 1
    clock.t = 2.0
    assert meter.lap().joules == 2.0
    assert meter.last_reason is None and meter.total_joules == 2.0


def test_device_failing_mid_run_makes_laps_not_measured_until_rebaselined():
    lost = RuntimeError("GPU is lost")
    meter, clock, _ = make(gpu0=[0, 1_000, 2_000, 3_000], gpu1=[0, lost, 9_000, 10_000])
    meter.start()
    clock.t = 1.0
    assert meter.lap() is None
    assert "gpu1" in meter.last_reason and "GPU is lost" in meter.last_reason
    # The next read of gpu1 works, but what it used in between is unknown: still not measured.
    clock.t = 2.0
    assert meter.lap() is None and "not readable" in meter.last_reason
    clock.t = 3.0
    reading = meter.lap()
    assert reading.joules == 2.0  # 1 J on each GPU
    assert meter.laps_not_measured == 2 and meter.total_joules == 2.0


def test_paused_windows_are_excluded():
    # Train 2 s (2 J), evaluate 8 s (8 J, excluded), train 3 s (3 J).
    meter, clock, _ = make(gpu0=[0, 2_000, 10_000, 13_000])
    meter.start()
    clock.t = 2.0
    meter.pause()
    assert meter.paused
    clock.t = 10.0
    meter.resume()
    clock.t = 13.0
    reading = meter.lap()
    assert (reading.joules, reading.seconds) == (5.0, 5.0)


def test_lap_while_paused_closes_the_lap_without_reading():
    meter, clock, reader = make(gpu0=[0, 2_000, 50_000, 51_000])
    meter.start()
    clock.t = 2.0
    meter.pause()
    clock.t = 30.0
    reading = meter.lap()
    assert (reading.joules, reading.seconds) == (2.0, 2.0)
    meter.resume()
    clock.t = 31.0
    assert meter.lap().joules == 1.0
    assert reader.exhausted()
    # pause/resume twice in a row are no-ops, not double counting
    meter.resume()
    meter.pause()
    meter.pause()


def test_failure_during_pause_is_recovered():
    meter, clock, _ = make(gpu0=[0, 1_000, RuntimeError("gone"), 7_000, 8_000, 20_000, 20_500])
    meter.start()
    clock.t = 1.0
    meter.pause()
    meter.resume()  # this read fails: no baseline for the next window
    clock.t = 2.0
    assert meter.lap() is None and "gone" in meter.last_reason
    # The lap's own read (7,000 mJ) became the baseline: the next lap is whole again.
    meter.pause()      # 8,000: +1 J
    meter.resume()     # 20,000: the pause is not counted
    clock.t = 3.0
    assert meter.lap().joules == 1.5  # 20,500: +0.5 J


def test_no_nvml_is_unavailable_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "import pynvml" raises ImportError
    meter = EnergyMeter([0])
    assert meter.start() is False
    assert meter.available is False and "nvidia-ml-py" in meter.reason
    assert meter.lap() is None and meter.last_reason == meter.reason
    meter.pause()
    meter.resume()


def test_no_cuda_device_is_unavailable(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    meter = EnergyMeter(reader=lambda dev: 0)
    assert meter.start() is False and "no CUDA device" in meter.reason


class NVMLError_NotSupported(Exception):
    pass


def fake_pynvml(counters, unsupported=False):
    """A stand-in pynvml module: exercises the real NVML reader path without a GPU."""
    mod = types.ModuleType("pynvml")
    calls = []

    def energy(handle):
        calls.append(handle)
        if unsupported:
            raise NVMLError_NotSupported("Not Supported")
        return counters[handle].pop(0)

    mod.nvmlInit = lambda: calls.append("init")
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.nvmlDeviceGetHandleByIndex = lambda i: f"index:{i}"
    mod.nvmlDeviceGetHandleByUUID = lambda u: f"uuid:{u}"
    mod.nvmlDeviceGetTotalEnergyConsumption = energy
    return mod, calls


def test_nvml_reader_by_index_and_uuid(monkeypatch):
    mod, calls = fake_pynvml({"index:3": [1_000, 4_000], "uuid:GPU-abc": [0, 500]})
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    clock = Clock()
    meter = EnergyMeter([3, "GPU-abc"], clock=clock)
    assert meter.start()
    clock.t = 1.0
    assert meter.lap().joules == 3.5
    meter.close()
    assert calls[0] == "init" and calls[-1] == "shutdown" and not meter.available


def test_gpu_without_energy_counter_is_unavailable(monkeypatch):
    mod, _ = fake_pynvml({}, unsupported=True)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    meter = EnergyMeter([0])
    assert meter.start() is False
    assert "NotSupported" in meter.reason


def test_summarize():
    # 8 GPUs at 600 W for 100 s = 480,000 J; 8,000,000 tokens -> 0.06 J/token; 480,000 J / 3.6e6 = 0.1333 kWh.
    s = summarize(480_000.0, 100.0, 8_000_000, 8)
    assert s.watts_per_gpu == pytest.approx(600.0)
    assert s.joules_per_token == pytest.approx(0.06)
    assert s.kwh == pytest.approx(480_000 / 3.6e6)


@pytest.mark.parametrize("args, name", [((-1, 1, 1, 1), "joules_total"), ((1, 0, 1, 1), "seconds"),
                                        ((1, 1, 0, 1), "tokens"), ((1, 1, 1, 0), "num_gpus")])
def test_summarize_rejects_bad_totals(args, name):
    with pytest.raises(ValueError, match=name):
        summarize(*args)
