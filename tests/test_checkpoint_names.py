"""What counts as a checkpoint of a run folder: its name says a step (#30: ``export_fp16`` was step 16)."""

from __future__ import annotations

import logging

from tatblimp_callback.commands.checkpoints import find_checkpoints


def test_only_folders_named_as_checkpoints_are_swept(tmp_path, caplog):
    names = ["checkpoint-10", "step_20", "ckpt30", "global_step40", "iter_0050", "60", "export_fp16", "merged_v2", "notes"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "checkpoint-70").mkdir()  # no model in it (yet): not a checkpoint either
    with caplog.at_level(logging.WARNING):
        found = find_checkpoints(tmp_path)
    # Before: export_fp16 was the checkpoint of step 16 and merged_v2 that of step 2.
    assert [(c.step, c.name) for c in found] == [
        (10, "checkpoint-10"),
        (20, "step_20"),
        (30, "ckpt30"),
        (40, "global_step40"),
        (50, "iter_0050"),
        (60, "60"),
    ]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "export_fp16 holds a model, but its name is not a checkpoint's" in warned[0]
    assert "merged_v2" in warned[1]
    find_checkpoints(tmp_path)  # a watching sweep polls again: named once
    assert len(caplog.records) == 2
