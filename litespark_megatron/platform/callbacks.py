"""Events of megatron.training's loop, for the modules that act on them: the one module that wraps its functions.

megatron.training (megatron-core 0.19.2) has no callbacks: its `train()` calls module globals of
megatron.training.training by name. `install()` wraps those globals, once per process, and each wrapper fires
events named like Megatron-LM's callbacks (Megatron Bridge's `on_train_step_end`, `on_eval_start`, ...) to the
listeners registered with `listen()`: telemetry, the hang watchdog, the checkpoint directory. When megatron-core
ships callbacks, this file changes and the listeners do not.

    wrapped function              event(s)                                   megatron.training calls it
    training_log                  on_train_step_end(iteration, loss_dict,    after every training step
                                  learning_rate, loss_scale, skipped,
                                  grad_norm)
    evaluate                      on_eval_start(), on_eval_end(loss_dict)    validation
                                  (on_test_* for the test set:
                                  evaluate_and_print_results is asked for it)
    save_checkpoint_and_time      skip_save(iteration) -> bool,              every save
                                  on_save_start(iteration),
                                  on_save_end(iteration, seconds, error)
    maybe_finalize_async_save     on_async_save_error(error)                 where --async-save's writes end
    load_checkpoint               on_load_end(seconds)                       setting up the model

Every listener hears every event, in the order they were registered; an exception a listener raises (a
listener's sys.exit) is raised after the others have heard it, before what the wrapped function raised.
tests/test_telemetry.py and tests/test_checkpoint_dir.py fail if megatron.training renames these functions or
stops calling them from its loop.
"""
from __future__ import annotations

import functools
import time
from typing import Dict

# The module globals of megatron.training.training wrapped here.
WRAPPED = ("training_log", "evaluate_and_print_results", "evaluate", "save_checkpoint_and_time",
           "maybe_finalize_async_save", "load_checkpoint")


class Listener:
    """What a listener may hear; each event does nothing unless a listener overrides it."""

    def on_train_step_end(self, iteration, loss_dict, learning_rate, loss_scale, skipped, grad_norm) -> None: ...
    def on_eval_start(self) -> None: ...
    def on_eval_end(self, loss_dict) -> None: ...  # None: the evaluation raised, or returned no losses
    def on_test_start(self) -> None: ...
    def on_test_end(self, loss_dict) -> None: ...
    def skip_save(self, iteration) -> bool: return False  # True: this save is not made, and no save event fires
    def on_save_start(self, iteration) -> None: ...
    def on_save_end(self, iteration, seconds, error) -> None: ...  # error: None, or what the save raised
    def on_async_save_error(self, error) -> None: ...
    def on_load_end(self, seconds) -> None: ...


_listeners: Dict[str, Listener] = {}


def listen(name: str, listener: Listener) -> None:
    """Register `listener` under `name` (a later one of the same name replaces it, where it was) and install the
    wrappers."""
    _listeners[name] = listener
    install()


def _fire(event: str, *args) -> list:
    """Every listener's answer to `event`; the first exception a listener raised, raised after all heard it."""
    answers, raised = [], None
    for listener in list(_listeners.values()):
        try:
            answers.append(getattr(listener, event)(*args))
        except BaseException as e:  # sys.exit of a listener included: the others still hear the event
            raised = raised or e
    if raised is not None:
        raise raised
    return answers


def install() -> None:
    """Wrap megatron.training.training's functions (once per process)."""
    from megatron.training import training

    if getattr(training.training_log, "__litespark__", False):
        return
    original = {name: getattr(training, name) for name in WRAPPED}
    phase = ["eval"]  # "test" while evaluate_and_print_results runs for the test set

    @functools.wraps(original["training_log"])
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *rest, **kwargs):
        result = original["training_log"](loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                          report_memory_flag, skipped_iter, grad_norm, *rest, **kwargs)
        _fire("on_train_step_end", iteration, loss_dict, learning_rate, loss_scale, skipped_iter, grad_norm)
        return result

    @functools.wraps(original["evaluate_and_print_results"])
    def evaluate_and_print_results(prefix, *args, **kwargs):
        phase[0] = "test" if "test set" in str(prefix) else "eval"
        try:
            return original["evaluate_and_print_results"](prefix, *args, **kwargs)
        finally:
            phase[0] = "eval"

    @functools.wraps(original["evaluate"])
    def evaluate(*args, **kwargs):
        kind = phase[0]
        _fire(f"on_{kind}_start")
        result = None
        try:
            result = original["evaluate"](*args, **kwargs)
        finally:
            _fire(f"on_{kind}_end", result[0] if result else None)
        return result

    @functools.wraps(original["save_checkpoint_and_time"])
    def save_checkpoint_and_time(iteration, *args, **kwargs):
        if any(_fire("skip_save", iteration)):
            return None
        _fire("on_save_start", iteration)
        t0 = time.perf_counter()
        try:
            result = original["save_checkpoint_and_time"](iteration, *args, **kwargs)
        except BaseException as error:
            _fire("on_save_end", iteration, time.perf_counter() - t0, error)
            raise
        _fire("on_save_end", iteration, time.perf_counter() - t0, None)
        return result

    @functools.wraps(original["maybe_finalize_async_save"])
    def maybe_finalize_async_save(*args, **kwargs):
        try:
            return original["maybe_finalize_async_save"](*args, **kwargs)
        except BaseException as error:
            _fire("on_async_save_error", error)
            raise

    @functools.wraps(original["load_checkpoint"])
    def load_checkpoint(*args, **kwargs):
        t0 = time.perf_counter()
        result = original["load_checkpoint"](*args, **kwargs)
        _fire("on_load_end", time.perf_counter() - t0)
        return result

    for function in (training_log, evaluate_and_print_results, evaluate, save_checkpoint_and_time,
                     maybe_finalize_async_save, load_checkpoint):
        function.__litespark__ = True
        setattr(training, function.__name__, function)

