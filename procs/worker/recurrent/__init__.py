"""Recurrent state's part in the worker (hybrid models' linear-attention layers): its step hooks (`step`).
The state pool itself is a kernel's (`kernels.recurrent_state`), built with the KV pool."""
