"""Learning faster: hyperparameter search (grid, random, successive halving / ASHA, population-based training,
Bayesian optimisation) over one trial interface and a folder of atomic result files (`store`); early stopping
with the best checkpoint restored (`early`); transfer learning and fine-tuning helpers (`transfer`).
`python -m dlo.tuning` drives a study as waves of a SLURM job array (slurm/search.sbatch)."""
