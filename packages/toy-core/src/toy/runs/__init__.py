"""Run bundles (``runs/<run_id>/``): writing events now; reading, listing and
comparing runs come with ``toy runs``."""

from toy.runs.writer import SCHEMA, RunWriter, new_run_id, runs_dir

__all__ = ["SCHEMA", "RunWriter", "new_run_id", "runs_dir"]
