"""Speculative decoding's part in the scheduler: prompt-lookup proposals (`ngram`) and the placeholder rows
a draft model fills in the worker (`draft_placeholders`). The worker's part: `procs/worker/speculation/`."""
