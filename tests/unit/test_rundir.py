"""Starting over removes what asyncgrpo wrote, entry by entry, and keeps (and names) everything else (issue 20, item 2)."""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.rundir import MARKER, OWNED_DIRS, clear_run

WRITTEN = [  # what a run (and the trackers it drives) writes
    "config.yaml", "metrics.jsonl", "samples.jsonl", "outcomes.jsonl", "error.txt", "timeline.jsonl", "trackers.json",
    "checkpoints/step_000002/model.safetensors", "checkpoints/.tmp-step_000004-123-0123abcd/state.json",
    "weights/v000003/model.safetensors", "plots/rewards.png", "plots/timeline_start.png",
    "tensorboard/events.out.tfevents.1796143379.vm.24424.0",
    "wandb/offline-run-20261201_164254-fkf8qo90/run.wandb", "wandb/run-20261201_164254-abc/files/x", "wandb/debug.log",
    "mlruns/0/meta.yaml", "mlruns/315934998097157724/meta.yaml", "mlruns/.trash/x",  # MLflow's file store, before sqlite
    "mlflow.db", "mlflow.db-journal", "mlartifacts/0/x", "mlartifacts/1/0123456789abcdef0123456789abcdef/artifacts/model.pt",
    "trackio/asyncgrpo.db", "trackio/asyncgrpo.db-wal", "trackio/asyncgrpo.db-shm", "trackio/asyncgrpo.lock",
    "trackio/my-project_2.db", "trackio/media/asyncgrpo/x.png", "trackio/artifacts/asyncgrpo/x", "trackio/traces/x",
]
USERS = [  # what a user put beside them
    "notes.md", "checkpoints/best_by_hand/model.safetensors", "checkpoints/README", "plots/my_figure.png",
    "weights/frozen.safetensors", "tensorboard/my_events/x", "wandb/settings", "wandb/run_notes.txt", "mlruns/compare.ipynb",
    "mlruns/2024_notes.md", "mlartifacts/README.md", "trackio/notes.md", "trackio/old_store/asyncgrpo.db",
]


def make(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def test_starting_over_removes_only_what_asyncgrpo_wrote_and_names_what_it_kept(tmp_path):
    make(tmp_path, [MARKER, *WRITTEN, *USERS])
    (tmp_path / "wandb" / "latest-run").symlink_to(tmp_path / "wandb" / "run-20261201_164254-abc")
    cleared = clear_run(tmp_path)
    assert files(tmp_path) == {MARKER, *USERS}
    assert sorted(cleared.kept) == sorted(
        ["checkpoints/README", "checkpoints/best_by_hand", "plots/my_figure.png", "weights/frozen.safetensors",
         "tensorboard/my_events", "wandb/run_notes.txt", "wandb/settings", "mlruns/2024_notes.md", "mlruns/compare.ipynb",
         "mlartifacts/README.md", "trackio/notes.md", "trackio/old_store"]
    )
    assert "checkpoints/step_000002" in cleared.removed and "wandb/latest-run" in cleared.removed


def test_directories_left_empty_go_and_a_directory_where_a_file_belongs_stays(tmp_path):
    make(tmp_path, WRITTEN)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    cleared = clear_run(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert cleared.kept == ["metrics.jsonl"]
    assert not any((tmp_path / name).exists() for name in OWNED_DIRS)


def test_a_linked_checkpoints_directory_is_emptied_of_checkpoints_and_stays_linked(tmp_path):
    elsewhere = tmp_path / "big_disk"
    make(elsewhere, ["step_000002/state.json", "mine.txt"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    clear_run(run_dir)
    assert (run_dir / "checkpoints").is_symlink() and files(elsewhere) == {"mine.txt"}
