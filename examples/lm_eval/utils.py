"""Dataset loader for the lm-eval task cachetune_musique_mc: the JSONL next to this file, as a "test"
split (found relative to this file, so lm_eval can run from any directory)."""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "musique_mc.jsonl"


def load_musique_mc(**kwargs):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(DATA))})
