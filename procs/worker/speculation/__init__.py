"""Speculative decoding's part in the worker: the draft model (`draft_model`) and its step hooks (`step`).
Prompt-lookup (n-gram) proposals are the scheduler's; their rows are verified as any proposed row is."""
