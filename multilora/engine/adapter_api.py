"""The Engine's adapter methods (a base class of Engine, kept apart so that engine.py stays the
step): register at start, load from a folder or from arrays, in-place replacement, mixes,
unload, listing.

An in-place load (`load_inplace=True` on a registered name) is copy-on-write: the new weights get
a registry entry of their own (and, on first use, a device slot of their own); requests added
before the call keep the entry they acquired, now under a hidden name, and finish on those
weights; its slot and host copy are freed when the last of them ends. Requests added after the
call use the new weights. Their prefix-cache keys start from the new weights' content hash, so no
KV page computed under the old weights serves them.
"""

from __future__ import annotations

from typing import Optional

from multilora.engine import lifecycle
from multilora.engine.commands import AddMix, LoadAdapter, UnloadAdapter
from multilora.model.loader import Progress
from multilora.adapters.adapter import LoRAAdapter, adapter_from_tensors, probe_adapter
from multilora.adapters.mix import MIX_PREFIX, check_weights, mix_adapters, mix_name, mix_path, parse_mix_path
from multilora.adapters.registry import AdapterConflictError


def version_tag(entry_version: int, content_hash: bytes) -> str:
    """Which weights answered, for a response: the name's load count and a short hash of the
    weights (equal tags: the same weights, whatever the name or the load)."""
    return f"v{entry_version}-{content_hash.hex()[:12]}"


class AdapterAPI:
    """Adapter management on the Engine (uses its registry, loader, residency, runner, cfg)."""

    def _register_at_start(self, lora_modules: dict[str, str], progress: bool) -> None:
        """The adapters given at start: each validated from its config and safetensors header
        (a bad one fails the start), registered unread, and read on first use; as many as the
        host tier holds are read in the background from here on. Thousands of adapters thus cost
        seconds at start, not a read of all their weights. Several processes read them all now
        (their prefix-cache keys must agree from the first request)."""
        if not lora_modules:
            return
        if self.slots is None:
            raise ValueError("LoRA is disabled (max_loras_per_batch=0)")
        import jax
        if jax.process_count() > 1:
            for name, path in lora_modules.items():
                self.load_lora_adapter(name, path)
            return
        bar = Progress(len(lora_modules), "adapters", progress and len(lora_modules) > 1)
        room = self.registry.max_host_bytes
        count = self.registry.max_loaded_loras
        for i, (name, path) in enumerate(lora_modules.items()):
            probe = probe_adapter(name, path, self.cfg, self.lora_cfg.max_lora_rank, self.lora_host_dtype)
            self.registry.register(name, str(path), probe=probe)
            if (room is None or probe.nbytes <= room) and (count is None or i < count):
                self.loader.prefetch(name, str(path))
                room = None if room is None else room - probe.nbytes
            bar.update(1)

    def read_adapter_async(self, name: str, path: str):
        """Read, validate and hash an adapter folder on the loader's low-priority worker thread
        (it touches no engine state): a concurrent Future of the LoRAAdapter, which
        load_lora_adapter(..., adapter=) then registers between steps. The server's path: reads
        never stall a step nor take the cores from the running streams."""
        if self.slots is None:
            raise ValueError("LoRA is disabled (max_loras_per_batch=0)")
        lifecycle.check_open(self, "read_adapter_async")
        return self.loader.submit(name, str(path))

    def load_lora_adapter(self, name: str, path: Optional[str] = None, pinned: bool = False,
                          adapter: Optional[LoRAAdapter] = None, *, tensors: Optional[dict] = None,
                          config: Optional[dict] = None, load_inplace: bool = False) -> None:
        """Register an adapter from its folder (`path`: read and validated now, unless `adapter`
        is given, already read by read_adapter_async off the engine thread) or from arrays
        (`tensors`: PEFT tensor names -> numpy or jax arrays, with `config`, a PEFT
        adapter_config dict: checked as a folder is, and copied). Raises AdapterError on a bad
        adapter, AdapterConflictError for a name already loaded without load_inplace; nothing
        changes then. With load_inplace=True a loaded name takes the new weights copy-on-write
        (the module's docstring)."""
        if self.slots is None:
            raise ValueError("LoRA is disabled (max_loras_per_batch=0)")
        if tensors is not None and (path is not None or adapter is not None):
            raise ValueError("load_lora_adapter: tensors replace path; give one of them")
        if path is None and tensors is None:
            raise ValueError("load_lora_adapter: give either path (an adapter folder) or tensors (with config)")
        if tensors is not None and config is None:
            raise ValueError("load_lora_adapter: tensors need config (a PEFT adapter_config dict)")
        if tensors is not None and self._sync is not None:
            raise ValueError("load_lora_adapter: tensors cannot reach the other processes of a multi-process "
                             "engine; save the adapter and load its folder")
        self._guard("load_lora_adapter")
        old = self.registry.entries.get(name)
        if old is not None and not load_inplace:
            raise AdapterConflictError(f"LoRA adapter {name!r} is already loaded; unload it first "
                                       "(or load it with load_inplace=True)")
        if old is not None and pinned:
            raise AdapterConflictError(f"LoRA adapter {name!r}: an in-place load cannot pin; unload it first")
        held = tensors is not None
        if held:
            adapter = adapter_from_tensors(name, tensors, config, self.cfg, self.lora_cfg.max_lora_rank,
                                           self.lora_host_dtype)
            path = adapter.path
        elif adapter is None and old is not None:
            adapter = self.registry._read(name, str(path))  # validated before anything changes
        if adapter is not None:
            adapter.content_hash  # noqa: B018  (hashed before the swap: an error changes nothing)
        if old is None:
            self.registry.register(name, str(path), pinned=pinned, adapter=adapter, held=held)
        else:
            self._replace(name, str(path), adapter, held)
        if not held:
            self._record(LoadAdapter(name, str(path), pinned, load_inplace))
        if pinned:
            self.residency.write_slots({name})

    def _replace(self, name: str, path: str, adapter: LoRAAdapter, held: bool) -> None:
        old, freed = self.registry.replace(name, path, adapter, held=held)
        retired = {name: old.name}
        # Mixes of the old weights are retired too: the next add_mix of the same parts builds
        # the mix anew from the new weights (its name is free), as the same weights would.
        for e in list(self.registry.entries.values()):
            if e.name == e.public_name and e.path.startswith(MIX_PREFIX) and not e.unloading \
                    and any(n == name for n, _, _ in parse_mix_path(e.path)):
                mix = e.name
                freed += self.registry.retire(mix)
                retired[mix] = e.name
        self.loader.forget(name)  # a read started before may hold the old contents of the same folder
        self.residency.waited_reads.discard(name)
        for req in self._requests.values():  # they finish on the weights they were added with
            if req.adapter in retired:
                req.adapter = retired[req.adapter]
        for slot in freed:
            self.runner.clear_slot(slot)

    def add_mix(self, weights: dict) -> str:
        """Register (once) the exact weighted mix of registered adapters, {name: weight}, as an
        adapter of its own (multilora.adapters.mix); returns its name, for add_request's lora. Its
        rank is the sum of the parts' ranks and must fit max_lora_rank. A mix of an adapter given
        as arrays is held in memory like that adapter (there is no folder to rebuild it from)."""
        if self.slots is None:
            raise ValueError("LoRA is disabled (max_loras_per_batch=0)")
        weights = check_weights(weights)
        name = mix_name(weights)
        entry = self.registry.entries.get(name)
        if entry is not None and not entry.unloading:
            return name
        parts = []
        for part, w in weights.items():
            e = self.registry.resolve(part)  # raises for unknown or unloading adapters
            if e.path.startswith(MIX_PREFIX):
                raise ValueError(f"adapters: {part!r} is itself a mix; name its parts instead")
            parts.append((part, e.path, w, self.registry.host_copy(e), e.held is not None))
        adapter = mix_adapters(name, mix_path([(n, p, w) for n, p, w, _, _ in parts]),
                               [(a, w) for _, _, w, a, _ in parts])
        if adapter.rank > self.lora_cfg.max_lora_rank:
            raise ValueError(f"adapters: the mix has rank {adapter.rank} (its parts' ranks add up), more than "
                             f"max_lora_rank={self.lora_cfg.max_lora_rank}; raise --max-lora-rank or mix fewer")
        self._guard("add_mix")
        self.registry.register(name, adapter.path, adapter=adapter, held=any(h for *_, h in parts))
        self._record(AddMix(weights))
        return name

    def unload_lora_adapter(self, name: str) -> None:
        """New requests for it are refused at once; running ones finish, then it is removed."""
        self._guard("unload_lora_adapter")
        slots = self.registry.unregister(name)
        self._record(UnloadAdapter(name))
        for slot in slots:
            self.runner.clear_slot(slot)

    def adapter_version(self, name: str) -> str:
        """The version tag (version_tag) of the weights `name` serves to requests added now."""
        e = self.registry.resolve(name)
        return version_tag(e.version, e.content_hash)

    def list_lora_adapters(self) -> list[dict]:
        """The names requests can use (replaced entries still finishing requests are not listed
        apart: their requests count under their name's active_requests)."""
        out: dict[str, dict] = {}
        for e in self.registry.entries.values():
            if e.public_name != e.name:
                continue
            out[e.name] = dict(name=e.name, path=e.path, id=e.id, pinned=e.pinned, rank=e.rank,
                               active_requests=e.refcount, unloading=e.unloading, slot=e.slot,
                               version=version_tag(e.version, e.content_hash))
        for e in self.registry.entries.values():
            if e.public_name != e.name and e.public_name in out:
                out[e.public_name]["active_requests"] += e.refcount
        return list(out.values())
