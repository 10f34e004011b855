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

# Run the tests (everything except `gpu` and `bench`); no tests collected is a failure.
test *args: setup
    rc=0; {{py}} -m pytest -m "not gpu and not bench" {{args}} || rc=$?; \
    if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit "$rc"

# Tests that need a GPU device (they skip themselves without one).
test-gpu *args: setup
    {{py}} -m pytest -m gpu {{args}}

# Lint Python code with ruff.
lint: setup
    {{venv}}/bin/ruff check packages tools tests
    {{venv}}/bin/ruff format --check packages tools tests

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

# Regenerate docs/reference/serve-api.md (the `toy serve` HTTP API, from the app's OpenAPI schema).
api-docs: setup
    {{py}} tools/serve_api_docs.py

# Fail if the committed server API page is stale.
api-docs-check: setup
    {{py}} tools/serve_api_docs.py --check

# The gate: lint, tests, docs build, the coverage check and the server API page check.
gate: lint test docs coverage-check api-docs-check

# Run the benchmarks (JSON lines on stdout; figures are ratios against a peer in the same run).
# The peer, llama-cpp-python (requirements/bench.txt), is installed on the first run: pip compiles
# it from source, about 10 minutes on two cores, once. $TOY_BENCH_LLAMA_PYTHON names another Python instead.
bench *args: (setup "--bench")
    {{py}} -m pytest -m bench -p no:cacheprovider -q -s {{args}} packages/*/benchmarks

# Remove build outputs (keeps .venv and the ggml source; `just clean-all` removes those too).
clean:
    rm -rf build site .pytest_cache .ruff_cache
    find . -name __pycache__ -type d -prune -not -path "./.venv/*" -exec rm -rf {} +

# Remove build outputs, .venv and the extracted ggml source.
clean-all: clean
    rm -rf {{venv}} packages/toy-ggml/subprojects/ggml
