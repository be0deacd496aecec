"""Multi-LoRA's part in the worker: the adapters and slots (`slots`), and its step hooks (`step`)."""
