"""Adapter management, above the model: adapter files and their validation (adapter, errors;
per_expert fuses transformers 4's per-expert MoE LoRA when read), reading them
(safetensors_views, loader, pacing), names, reference counts and the host tier (registry),
mixes of adapters (mix), and the device pool of slots that the model reads (pool). The LoRA
compute itself (backends, batch info) stays below the model, in multilora.lora."""
