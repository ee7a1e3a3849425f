"""Where metrics go: the console, TensorBoard and `metrics.jsonl` (one JSON object per record, with its step).

Only one rank writes (the trainer passes `enabled` for global rank 0). A value of None means "not measured" (e.g.
GPU energy on a CPU run): it is written as null to the JSON file and left out of TensorBoard, never as a number.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional


class MetricsSink:
    def __init__(self, jsonl_path: Optional[str], tensorboard_dir: Optional[str], enabled: bool = True):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._file = open(jsonl_path, "a", buffering=1)  # line-buffered: a crash loses at most one record
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)

    def log(self, step: int, kind: str, values: dict) -> None:
        """kind: "train", "val", "test" or "run". TensorBoard tag: "<kind>/<name>" unless the name has a '/'."""
        if not self.enabled:
            return
        if self._file:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
            self._file.write(json.dumps({"step": step, "kind": kind, **clean}, sort_keys=False) + "\n")
        if self._tb:
            for name, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value is None:
                    continue
                if isinstance(value, float) and not math.isfinite(value):
                    continue
                self._tb.add_scalar(name if "/" in name else f"{kind}/{name}", value, step)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled and self._tb:
            self._tb.add_text(tag, text, step)

    def flush(self) -> None:
        if self._tb:
            self._tb.flush()
        if self._file:
            self._file.flush()

    def close(self) -> None:
        if self._tb:
            self._tb.close()
            self._tb = None
        if self._file:
            self._file.close()
            self._file = None
