"""Where measurements go: the recorder, its sinks (console, JSONL, W&B), summary.json, the run lock."""
