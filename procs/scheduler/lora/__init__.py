"""Multi-LoRA's part in the scheduler: which adapters the worker holds, loads and unloads
(`adapter_updates`). The worker's part: `procs/worker/lora/`."""
