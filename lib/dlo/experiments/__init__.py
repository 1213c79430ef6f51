"""Each day's experiment runners: what a notebook measures, in one module per day (`dlo.experiments.day4`).

Engines (DDP, ZeRO, pipeline, tensor parallel) live in `dlo.distributed`; the code here builds the
day's models and data at the preset's scale, runs the engines, and returns plain rows for the
notebook's tables and plots.
"""
