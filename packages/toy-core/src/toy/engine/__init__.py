"""Inference engines: KV cache, batched prefill/decode, sampling, generation.

``toy.engine.sampling`` turns logits into tokens (vectorized NumPy);
``toy.engine.kv`` holds the KV cache and its cell bookkeeping;
``toy.engine.llm`` runs the llama-family forward over the cache for several
sequences at once; ``toy.engine.generate`` is the loaded-model API behind
``toy.load``.
"""
