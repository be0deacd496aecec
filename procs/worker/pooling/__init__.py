"""The pooling runner's part in the worker (embeddings, rerank): the poolers (`pooler`) and the step head
that replaces sampling (`step`)."""
