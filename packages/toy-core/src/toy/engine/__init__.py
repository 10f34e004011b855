"""Inference: KV cache, batched prefill/decode, sampling, constrained and plain generation.

``toy.engine.kv`` holds the KV cache and its cell bookkeeping;
``toy.engine.llm`` runs any registered language model's forward
(``toy.models``) over the cache for several sequences at once;
``toy.engine.sampling`` turns logits into tokens (vectorized NumPy),
``toy.engine.stop`` matches stop strings and ``toy.engine.constrain`` masks
tokens for JSON schemas, grammars and regexes; ``toy.engine.decoding`` is one
request's token step (sampler, stops, UTF-8 decoder, limits) and the
prefix-reuse rule, shared by ``toy.engine.generate`` (the loaded-model API
behind ``toy.load``) and the server's worker. Adapters applied here come from
``toy.adapters``; training graphs are ``toy.train.stepgraph``'s.
"""
