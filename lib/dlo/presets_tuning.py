"""The preset of Day 11 (learning faster: transfer learning, early stopping, hyperparameter search, energy),
a one-process day whose searches run their trials inline on a CPU and as a SLURM array at the full scale.

`dlo.presets` holds its instances per profile; import the class from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Day11Preset:
    """Day 11. Defaults are the `tiny` scale: SmallCNN of width 8 on synthetic 8x8 CIFAR-10-shaped images."""

    image_size: int = 8
    width: int = 8                 # SmallCNN base width (about 25k parameters at 8)
    batch_size: int = 32
    n_test: int = 512              # held-out images of each task (the transfer target's and the search's)
    # transfer: pretrained on classes 0-4 (task A), transferred to classes 5-9 (task B)
    n_pretrain: int = 2048
    pretrain_steps: int = 200
    labelled: tuple = (32, 128, 512)   # labelled examples of task B: the curve where transfer pays
    transfer_steps: int = 60
    lr: float = 3e-3               # AdamW: the head's rate and training from scratch
    finetune_factor: float = 10.0  # fine-tuning everything at lr / finetune_factor ("fine" in fine-tuning)
    # early stopping
    es_train: int = 256            # training images of task B, one epoch = es_train / batch_size steps
    max_epochs: int = 24
    patience: int = 3
    # the searches: trials of dlo.tuning.trials.small_cnn_trial on the 10-class task
    n_search_train: int = 256
    n_search_test: int = 256
    trials: int = 9                # random and grid (3 x 3) at equal budget; ASHA's configs
    trial_steps: int = 27          # full budget R of a trial; ASHA's rungs min_steps x eta^k up to it
    min_steps: int = 3
    eta: int = 3
    search_seeds: int = 4          # the searches repeated with another data and initialisation seed
    # the searches that adapt (run on the first adaptive_seeds search seeds), each against random search's trials
    bayes_trials: int = 9          # BO's budget (random search's): its first bayes_init trials are random's first ones
    bayes_init: int = 3
    pbt_population: int = 4        # PBT's members: random search's first configs, trained to trial_steps
    pbt_interval: int = 9          # steps between exploit/explore (trial_steps / pbt_interval generations)
    adaptive_seeds: int = 3
    seeds: int = 5                 # repeats of the transfer and early-stopping trainings (paired)
    grid_g_per_kwh: float = 300.0  # stated grid intensity (gCO2e / kWh): a parameter, not a measurement
    tdp_watts: float = 65.0        # stated CPU package TDP for the estimate when no counter is readable

    def validate(self) -> None:
        if self.seeds < 3 or self.search_seeds < 3:
            raise ValueError(f"seeds and search_seeds must be >= 3 (an interval needs 3 samples), got "
                             f"{self.seeds}, {self.search_seeds}")
        if not 1 <= self.min_steps <= self.trial_steps or self.eta < 2 or self.trials < 4:
            raise ValueError(f"need 1 <= min_steps <= trial_steps, eta >= 2 and trials >= 4; got {self.min_steps}, "
                             f"{self.trial_steps}, {self.eta}, {self.trials}")
        if not (1 <= self.bayes_init <= self.bayes_trials <= self.trials and 2 <= self.pbt_population <= self.trials
                and self.trial_steps % self.pbt_interval == 0 and 3 <= self.adaptive_seeds <= self.search_seeds):
            raise ValueError(f"need 1 <= bayes_init <= bayes_trials <= trials, 2 <= pbt_population <= trials, "
                             f"trial_steps a multiple of pbt_interval and 3 <= adaptive_seeds <= search_seeds; got "
                             f"{self.bayes_init}, {self.bayes_trials}, {self.pbt_population}, {self.pbt_interval}, "
                             f"{self.adaptive_seeds}")
        if round(self.trials ** 0.5) ** 2 != self.trials:
            raise ValueError(f"trials must be a square (the grid is sqrt(trials) x sqrt(trials)), got {self.trials}")
        if self.es_train < self.batch_size or self.patience < 1 or self.max_epochs <= self.patience:
            raise ValueError(f"need es_train >= batch_size, patience >= 1 and max_epochs > patience; got "
                             f"{self.es_train}, {self.patience}, {self.max_epochs}")
        if not self.labelled or min(self.labelled) < 5:
            raise ValueError(f"labelled needs sizes >= 5 (one image per class of task B), got {self.labelled}")

    def smoke(self) -> Day11Preset:
        """The same models at the preset's image size and width; a few thousand images, a handful of steps and
        the smallest study (every trial makes its data anew: 50k images each would be the step's whole time)."""
        return replace(self, n_pretrain=min(self.n_pretrain, 2048), pretrain_steps=5, transfer_steps=3,
                       labelled=self.labelled[:2], es_train=min(self.es_train, 1024), max_epochs=4, patience=1,
                       n_search_train=min(self.n_search_train, 1024), n_search_test=min(self.n_search_test, 512),
                       n_test=min(self.n_test, 512), trials=4, trial_steps=4, min_steps=1, eta=2,
                       bayes_trials=min(self.bayes_trials, 4), bayes_init=min(self.bayes_init, 2),
                       pbt_population=min(self.pbt_population, 4), pbt_interval=2)

    def with_max_steps(self, steps: int) -> Day11Preset:
        """`max_steps` sets the pretraining's steps (the other trainings keep theirs)."""
        return replace(self, pretrain_steps=steps)
