"""The adapter directory: one named Ray actor, the source of truth for which adapters the
deployment serves (name -> {path, pinned, rev}, with a version every change bumps; rev counts the
in-place loads of one name, so that replicas tell new weights from old at the same path)."""

from __future__ import annotations

import time
from typing import Optional

from multilora.server.ray.config import DIRECTORY_NAMESPACE, RayServeConfig

# ---- the adapter directory (a named Ray actor) ---------------------------------------------------
class AdapterDirectory:
    """name -> {"path", "pinned", "rev"}: which adapters the deployment serves, whatever replica answers.
    A plain class; run as one Ray actor (its calls run one at a time, so each is atomic)."""

    def __init__(self, seed: Optional[dict[str, dict]] = None):
        self.entries: dict[str, dict] = {}
        self._version = 0
        self.seed(seed or {})

    def version(self) -> int:
        return self._version

    def snapshot(self) -> tuple[int, dict[str, dict]]:
        return self._version, {n: dict(e) for n, e in self.entries.items()}

    def seed(self, entries: dict[str, dict]) -> int:
        """Add the entries whose names are not there yet (a redeploy keeps runtime loads)."""
        for name, e in entries.items():
            if name not in self.entries:
                self.entries[name] = {"path": str(e["path"]), "pinned": bool(e.get("pinned", False)), "rev": 0}
                self._version += 1
        return self._version

    def add(self, name: str, path: str, pinned: bool = False) -> tuple[bool, Optional[dict]]:
        """(True, None) when added; (False, the entry there) when the name is taken. Adding the
        same name and path again is a success that changes nothing."""
        have = self.entries.get(name)
        if have is not None:
            return have["path"] == str(path), dict(have)
        self.entries[name] = {"path": str(path), "pinned": bool(pinned), "rev": 0}
        self._version += 1
        return True, None

    def replace(self, name: str, path: str, pinned: bool = False) -> dict:
        """An in-place load (load_inplace): the entry takes the new path and a new rev (added
        when absent); every replica loads the new weights in place at its next sync."""
        have = self.entries.get(name)
        rev = have["rev"] + 1 if have is not None else 0
        self.entries[name] = {"path": str(path), "pinned": bool(pinned), "rev": rev}
        self._version += 1
        return dict(self.entries[name])

    def remove(self, name: str) -> Optional[dict]:
        """The removed entry, or None when there was none."""
        entry = self.entries.pop(name, None)
        if entry is not None:
            self._version += 1
        return entry


def create_directory(cfg: RayServeConfig, lifetime: Optional[str] = "detached"):
    """The deployment's directory actor, created (seeded with --lora-modules) or, when it runs
    already (a redeploy), reused and seeded with the names it lacks."""
    import ray
    seed = {n: {"path": p, "pinned": False} for n, p in (cfg.engine_kwargs.get("lora_modules") or {}).items()}
    actor = ray.remote(AdapterDirectory).options(
        name=cfg.directory_name, namespace=DIRECTORY_NAMESPACE, get_if_exists=True, lifetime=lifetime,
        num_cpus=0, max_concurrency=1).remote(seed)
    ray.get(actor.seed.remote(seed))
    return actor


def get_directory(cfg: RayServeConfig, timeout: float = 60.0):
    import ray
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(cfg.directory_name, namespace=DIRECTORY_NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the adapter directory actor {cfg.directory_name!r} (namespace "
                                   f"{DIRECTORY_NAMESPACE!r}) does not exist: build the application with "
                                   "multilora.server.ray_serve.build_application") from None
            time.sleep(0.2)
