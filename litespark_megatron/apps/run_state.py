"""The resumable apps' state file (the efficiency suite's, the inference benchmark's): what each run of an --out
directory ended with, so the same command continues it. Written whole or not at all (a temporary file, then a
rename); read only by a command with the same settings."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UserError


def load_state(out: Path, name: str, version: int, identity: dict, entries: str, what: str, restart: str) -> dict:
    """The state in out/name, or a fresh one. `entries`: the key of its runs; `what` ("suite"): what the directory
    holds, in the messages; `restart`: how the unreadable-state messages say to start again."""
    path = out / name
    if not path.exists():
        return {"version": version, "settings": identity, entries: {}}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable {what} state ({e}); delete it to {restart}") from None
    if state.get("version") != version or not isinstance(state.get(entries), dict):
        raise UserError(f"{path}: not a {what} state this version writes; delete it to {restart}")
    if state.get("settings") != identity:
        old = state.get("settings") or {}
        differ = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
        raise UserError(f"{out} holds a {what} with other settings (different: {', '.join(differ)}); use another "
                        f"--out, or the same settings to continue it")
    return state


def save_state(out: Path, name: str, state: dict) -> None:
    tmp = out / (name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / name)
