"""The SmallCNN trial: resuming from its checkpoint (an ASHA promotion) is training straight through, bit for
bit; a search over it runs end to end."""

from dlo.tuning.search import Asha
from dlo.tuning.space import Space
from dlo.tuning.store import Study
from dlo.tuning.trials import small_cnn_trial

CONFIG = {"lr": 3e-3, "width": 4, "n_train": 128, "n_test": 64, "batch_size": 16}


def test_resumed_trial_equals_one_run_straight_through(tmp_path):
    first = small_cnn_trial(CONFIG, 3, tmp_path / "cut")
    rest = small_cnn_trial(CONFIG, 6, tmp_path / "cut")
    whole = small_cnn_trial(CONFIG, 6, tmp_path / "whole")
    assert len(first) == 3 and len(rest) == 3
    assert [m["train_loss"] for m in first + rest] == [m["train_loss"] for m in whole]
    assert rest[-1]["val_loss"] == whole[-1]["val_loss"] and 0 <= whole[-1]["val_acc"] <= 1


def test_asha_over_the_small_cnn(tmp_path):
    space = Space({"lr": {"log_uniform": [1e-4, 3e-2]}, "width": {"choice": [4]}, "n_train": {"choice": [128]},
                   "n_test": {"choice": [64]}, "batch_size": {"choice": [16]}})
    study = Study(tmp_path, metric="val_loss", durable=False)
    found = Asha(space, min_steps=2, max_steps=6, eta=3, n_configs=3, seed=0).run(study, small_cnn_trial, width=None)
    assert found.steps == 6 and study.steps_run() == 3 * 2 + 1 * 4
